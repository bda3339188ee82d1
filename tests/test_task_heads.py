"""Task heads from a config's ``architectures``: the model built is the head named, its made batch
carries the labels that head's loss reads, and the estimate is graded by the CPU allocator."""

import pytest
import torch
import transformers as tf

import memfit
from memfit import Recipe
from memfit.estimator.truth import true_peak
from memfit.models.source import resolve

BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
            max_position_embeddings=64)


def _config_json(tmp_path, config) -> str:
    config.save_pretrained(str(tmp_path))
    return str(tmp_path / "config.json")


def _graded(path, recipe=Recipe(), rows=3, seq_len=16):
    """(estimate, allocator truth, the source) of ``path``: the same made batch, fake and real."""
    source = resolve(path)
    batch = source.make_batch(rows, seq_len)
    report = memfit.estimate(path, batch_size=rows, seq_len=seq_len, recipe=recipe)
    return report.peak_bytes, true_peak(source.build, batch, recipe=recipe), source, batch


def test_bert_sequence_classification_is_not_a_masked_lm(tmp_path):
    path = _config_json(tmp_path, tf.BertConfig(**BERT, architectures=["BertForSequenceClassification"],
                                                num_labels=3))
    estimated, measured, source, batch = _graded(path)
    assert source.task == "sequence-classification"
    assert type(source.build()).__name__ == "BertForSequenceClassification"
    assert batch["labels"].shape == (3,) and batch["labels"].dtype == torch.int64
    assert 0 <= batch["labels"].min() and batch["labels"].max() < 3
    assert abs(estimated - measured) <= 16, (estimated, measured)  # measured: equal to the byte
    masked = memfit.estimate(tf.BertConfig(**BERT), batch_size=3, seq_len=16).peak_bytes  # what it was before
    assert estimated < masked  # no vocabulary-wide decoder, no per-token logits


def test_bert_sequence_classification_with_lora_trains_the_new_head(tmp_path):
    path = _config_json(tmp_path, tf.BertConfig(**BERT, architectures=["BertForSequenceClassification"],
                                                num_labels=3))
    recipe = Recipe(lora="lora:4", lora_targets="query,value", lora_dropout=0.1)
    estimated, measured, source, _ = _graded(path, recipe)
    model, _, _ = memfit.apply(source.build(), recipe)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # peft's modules_to_save (task_type SEQ_CLS): a trainable copy of the classifier beside the original
    assert {n for n in trainable if "lora_" not in n} == {"base_model.model.classifier.modules_to_save.default.weight",
                                                           "base_model.model.classifier.modules_to_save.default.bias"}
    assert len([n for n in trainable if "lora_" in n]) == 2 * 2 * 2  # A and B, query and value, two blocks
    assert abs(estimated - measured) <= 4 * len(trainable) + 16, (estimated, measured)  # AdamW step counters


def test_token_classification_labels_every_token(tmp_path):
    path = _config_json(tmp_path, tf.BertConfig(**BERT, architectures=["BertForTokenClassification"], num_labels=5))
    estimated, measured, source, batch = _graded(path)
    assert source.task == "token-classification"
    assert batch["labels"].shape == batch["input_ids"].shape == (3, 16) and batch["labels"].max() < 5
    assert abs(estimated - measured) <= 16, (estimated, measured)  # 4-byte scalars are rounded apart


def test_question_answering_has_span_positions(tmp_path):
    path = _config_json(tmp_path, tf.BertConfig(**BERT, architectures=["BertForQuestionAnswering"]))
    estimated, measured, source, batch = _graded(path)
    assert source.task == "question-answering" and set(batch) == {"input_ids", "start_positions", "end_positions"}
    assert batch["start_positions"].shape == (3,) and batch["end_positions"].max() < 16
    assert abs(estimated - measured) <= 16, (estimated, measured)  # 4-byte scalars are rounded apart


def test_vit_image_classification(tmp_path):
    config = tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                          image_size=32, patch_size=8, num_labels=4, architectures=["ViTForImageClassification"])
    path = _config_json(tmp_path, config)
    estimated, measured, source, batch = _graded(path, seq_len=None)
    assert source.task == "image-classification"
    assert batch["pixel_values"].shape == (3, 3, 32, 32) and batch["labels"].shape == (3,)
    # the patch convolution's oneDNN scratch is modelled, not traced (README: ViT within a few %)
    assert abs(estimated - measured) / measured < 0.05, (estimated, measured)


def test_a_decoder_classifier_gets_a_padding_id_and_regression_gets_floats(tmp_path):
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, num_labels=1,
                            architectures=["LlamaForSequenceClassification"], eos_token_id=2)
    config.pad_token_id = None
    estimated, measured, source, batch = _graded(_config_json(tmp_path, config))
    assert source.config.pad_token_id == 2  # eos, as fine-tuning scripts set it; the caller's config is left alone
    assert config.pad_token_id is None
    assert batch["labels"].dtype == torch.float32 and batch["labels"].shape == (3,)  # num_labels 1: regression
    assert abs(estimated - measured) <= 16, (estimated, measured)  # 4-byte scalars are rounded apart


@pytest.mark.parametrize("arch, task", [("T5ForConditionalGeneration", "seq2seq"), ("BertForMaskedLM", "masked-lm"),
                                        ("GPT2LMHeadModel", "causal-lm"), ("RobertaForTokenClassification",
                                                                           "token-classification")])
def test_other_architectures_keep_their_task(arch, task):
    from memfit.models.tasks import task_of

    assert task_of([arch]) == task
    assert task_of(["SomethingElse"]) is None and task_of(None) is None
