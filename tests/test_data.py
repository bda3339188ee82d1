"""Training data: token files, JSONL (ids or text through a local tokenizer), the resumable order,
padding; bad input one line."""

import json

import numpy as np
import pytest
import torch

from memfit import MemfitError
from memfit.training.data import IGNORE, JsonlTexts, Order, TokenBlocks, collate, open_data


def test_token_file_blocks(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    data = open_data(path, seq_len=64)
    assert isinstance(data, TokenBlocks) and len(data) == 15 and set(data.lengths) == {64}
    assert torch.equal(data[2]["input_ids"], torch.arange(128, 192))
    with pytest.raises(MemfitError, match="smaller --seq-len"):
        TokenBlocks(path, 4096)


def _local_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate("the cat sat on a mat".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    fast.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_jsonl_text_and_ids(tmp_path):
    text = tmp_path / "t.jsonl"
    text.write_text("\n".join(json.dumps({"text": t}) for t in ["the cat sat", "a mat", "the cat sat on a mat"]))
    data = JsonlTexts(text, tokenizer=_local_tokenizer(tmp_path), max_len=4)
    assert list(data.lengths) == [3, 2, 4]
    assert data[0]["input_ids"].tolist() == [2, 3, 4]
    ids = tmp_path / "i.jsonl"
    ids.write_text('{"input_ids": [5, 6, 7]}\n\n{"input_ids": [8]}\n')
    assert list(open_data(ids, seq_len=8).lengths) == [3, 1]
    with pytest.raises(MemfitError, match="pass a tokenizer"):
        JsonlTexts(text)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(MemfitError, match=r"b.jsonl:2: not JSON"):
        JsonlTexts(bad, tokenizer=_local_tokenizer(tmp_path))
    with pytest.raises(MemfitError, match="unknown data"):
        open_data(tmp_path / "x.csv", seq_len=8)


def test_order_resumes_exactly_across_epochs():
    whole = Order(10, seed=3)
    drawn = [whole.take(4) for _ in range(7)]
    flat = [i for chunk in drawn for i in chunk]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # a new permutation each epoch
    first = Order(10, seed=3)
    for _ in range(3):
        first.take(4)
    resumed = Order(10, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.take(4) for _ in range(4)] == drawn[3:]
    with pytest.raises(MemfitError, match="same data and seed"):
        Order(11, seed=3).load_state_dict(first.state_dict())


def test_collate_pads_with_ignored_labels():
    batch = collate([{"input_ids": torch.tensor([4, 5, 6])}, {"input_ids": torch.tensor([7])}])
    assert batch["input_ids"].tolist() == [[4, 5, 6], [7, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[4, 5, 6], [7, IGNORE, IGNORE]]
