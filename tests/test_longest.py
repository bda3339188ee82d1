"""longest(): the longest sequence a recipe fits, checked by full estimates on both sides of the answer, against the
CPU allocator, and through the CLI (``memfit fit --longest``)."""

import json

import pytest
import transformers as tf

from memfit import Hardware, MemfitError, Recipe, estimate
from memfit.cli import main
from memfit.estimator.truth import true_peak
from memfit.models.source import resolve
from memfit.planner.longest import Longest, NoLengthFits, longest

MIB = 2**20


def _config():
    return tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096,
                          architectures=["LlamaForCausalLM"])


def test_longest_on_the_cpu_agrees_with_the_allocator():
    """The answer fits the budget for real and ``multiple`` tokens more do not (the CPU allocator's own events: on
    the CPU the estimate is byte-exact for this model, so the edge is sharp)."""
    budget = 6 * MIB
    found = longest(_config(), device="cpu", budget=budget, multiple=8)
    s = found.seq_len
    assert isinstance(found, Longest) and s % 8 == 0 and 64 <= s < 4096 and found.device_bytes <= budget
    assert found.next_bytes > budget and found.estimates >= 3
    source = resolve(_config())
    assert true_peak(source.build, source.make_batch(1, s, None)) <= budget
    assert true_peak(source.build, source.make_batch(1, s + 8, None)) > budget


def test_longest_on_a_card_is_the_edge_of_its_verdict():
    """Under CUDA semantics: the answer's verdict fits and one token more does not, by full estimates; two rows a
    micro-batch fit fewer tokens each."""
    recipe = Recipe(precision="bf16-mixed", checkpointing="blocks")
    budget = 1200 * MIB
    found = longest(_config(), gpu="rtx-4090", budget=budget, recipe=recipe)
    at = estimate(_config(), recipe=recipe, gpu="rtx-4090", budget=budget, batch_size=1, seq_len=found.seq_len)
    above = estimate(_config(), recipe=recipe, gpu="rtx-4090", budget=budget, batch_size=1, seq_len=found.seq_len + 1)
    assert at.verdict == "fits" and above.verdict != "fits" and at.device_bytes == found.device_bytes
    two = longest(_config(), gpu="rtx-4090", budget=budget, recipe=recipe, micro_batch_size=2, multiple=64)
    assert two.seq_len < found.seq_len and two.micro_batch_size == 2 and two.seq_len % 64 == 0


def test_nothing_fits_is_one_line():
    with pytest.raises(NoLengthFits, match="nothing fits .* need .*; try"):
        longest(_config(), device="cpu", budget=MIB)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(multiple=0), "multiple must be a positive integer"),
    (dict(micro_batch_size=1.5), "micro_batch_size must be a positive integer"),
    (dict(limit=4, multiple=8), "shorter than multiple"),
    (dict(recipe=Recipe(micro_batch_size=2)), "micro_batch_size="),
    (dict(budget=None, device=None, hardware=Hardware(gpu="h100-sxm", gpus=2)), "longest searches one device"),
])
def test_bad_input_is_one_line(kwargs, needle):
    kwargs = {"budget": 6 * MIB, "device": "cpu", **kwargs}
    with pytest.raises(MemfitError, match=needle):
        longest(_config(), **kwargs)


def test_cli_fit_longest(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(_config().to_json_string())
    assert main(["fit", str(path), "--device", "cpu", "--budget", "6MiB", "--longest", "--seq-multiple", "8",
                 "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] and answer["seq_len"] % 8 == 0 and answer["micro_batch_size"] == 1
    assert answer["next_bytes"] > answer["budget_bytes"] >= answer["device_bytes"]
    assert main(["fit", str(path), "--device", "cpu", "--budget", "6MiB", "--longest", "--seq-multiple", "8"]) == 0
    assert f"{answer['seq_len']:,} tokens" in capsys.readouterr().out
    # --longest searches the length: a --seq-len beside it, or a budget nothing fits, is one line
    assert main(["fit", str(path), "--device", "cpu", "--budget", "6MiB", "--longest", "--seq-len", "64"]) == 2
    assert "--seq-len" in capsys.readouterr().err
    assert main(["fit", str(path), "--device", "cpu", "--budget", "1MiB", "--longest"]) == 1
    assert "nothing fits" in capsys.readouterr().err
    assert main(["fit", str(path), "--device", "cpu", "--budget", "6MiB", "--seq-multiple", "8"]) == 2
    assert "--seq-multiple goes with --longest" in capsys.readouterr().err
