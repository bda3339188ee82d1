"""Recipe: validation, serialisation, exactness, and every pair of fields."""

import itertools

import pytest
import transformers as tf

import memfit
from memfit import Recipe
from memfit.errors import MemfitError

# One non-default value per field.
CHANGED = {"precision": "bf16-mixed", "checkpointing": "blocks", "offload_activations": True,
           "attention": "eager", "chunked_loss": 2, "optimizer": "sgd", "optimizer_in_backward": True,
           "offload_optimizer": True, "micro_batch_size": 2, "grad_accum_steps": 2, "lora": "lora:8"}


def _config():  # one block: every field and pair answers as with two (same errors, word for word), in 2/3 the time
    return tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)


def _run(**fields):
    return memfit.estimate(_config(), seq_len=16, batch_size=2, recipe=Recipe(**fields))


def test_yaml_and_json_round_trip(tmp_path):
    recipe = Recipe(precision="bf16-mixed", checkpointing="blocks:2", grad_accum_steps=4, micro_batch_size=2)
    for name in ("r.yaml", "r.json"):
        recipe.save(str(tmp_path / name))
        assert Recipe.load(str(tmp_path / name)) == recipe


def test_unknown_fields_and_values_are_one_line_errors(tmp_path):
    (tmp_path / "bad.yaml").write_text("precision: fp8\n")
    with pytest.raises(MemfitError, match="precision"):
        Recipe.load(str(tmp_path / "bad.yaml"))
    with pytest.raises(MemfitError, match="the fields are"):
        Recipe.from_dict({"checkpoint": "blocks"})
    with pytest.raises(MemfitError, match="blocks:2"):
        Recipe(checkpointing="sometimes")


def test_exactness_is_declared():
    assert Recipe(checkpointing="blocks", grad_accum_steps=8).is_exact
    assert not Recipe(optimizer="adamw8bit").is_exact
    assert not Recipe(lora="qlora:16", precision="bf16-mixed").is_exact
    assert Recipe(precision="bf16").approximations == ["precision=bf16"]


@pytest.fixture(scope="module")
def alone() -> dict:
    """Fields whose value cannot run on this machine by itself, with the reason (once for the file)."""
    out = {}
    for field, value in CHANGED.items():
        try:
            _run(**{field: value})
        except MemfitError as err:
            out[field] = str(err)
    return out


def test_every_field_alone_works_or_says_why(alone):
    # on a CPU-only machine optimizer offload needs CUDA
    assert set(alone) <= {"offload_optimizer"}
    for field, message in alone.items():
        assert field in message


def test_every_pair_works_or_names_both_fields(alone):
    fields = [f for f in CHANGED if f not in alone]
    failures = []
    for a, b in itertools.combinations(fields, 2):
        try:
            _run(**{a: CHANGED[a], b: CHANGED[b]})
        except MemfitError as err:
            if a not in str(err) or b not in str(err):
                failures.append((a, b, str(err)))
    assert not failures, failures


def test_qlora_with_every_other_field_works_or_names_both():
    failures = []
    for field, value in CHANGED.items():
        if field in ("precision", "lora", "offload_optimizer"):
            continue
        try:
            _run(precision="bf16-mixed", lora="qlora:8", **{field: value})
        except MemfitError as err:
            if field not in str(err) or "lora" not in str(err):
                failures.append((field, str(err)))
    assert not failures, failures
    with pytest.raises(MemfitError, match="lora=qlora:8 and precision=fp32"):
        _run(lora="qlora:8")
