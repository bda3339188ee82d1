"""Bad input is one MemfitError line that names the fix."""

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.errors import MemfitError
from memfit.models.zoo import MLP, classify

BATCH = (torch.randn(4, 256), torch.randint(0, 10, (4,)))


def _one_line(err):
    text = str(err.value)
    assert "\n" not in text and text
    return text


def test_batch_the_model_rejects_gives_the_models_message():
    with pytest.raises(MemfitError) as err:
        memfit.estimate(MLP, (torch.randn(4, 7), torch.randint(0, 10, (4,))), loss_fn=classify)
    assert "rejected the batch" in _one_line(err) and "7" in str(err.value)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x[x.sum(1) > 0]).sum()  # boolean mask: output shape depends on values


def test_op_that_cannot_run_on_fake_tensors_names_the_op_and_measure():
    with pytest.raises(MemfitError) as err:
        memfit.estimate(DataDependent, torch.randn(4, 8), loss_fn=lambda m, b: m(b))
    text = _one_line(err)
    assert "aten." in text and "measure" in text
    # and measure does run it
    assert memfit.measure(DataDependent, torch.randn(4, 8), loss_fn=lambda m, b: m(b)).peak_bytes > 0


def test_loss_that_is_not_a_scalar():
    with pytest.raises(MemfitError, match="scalar") as err:
        memfit.estimate(MLP, BATCH, loss_fn=lambda m, b: m(b[0]))
    _one_line(err)


def test_tuple_batch_without_loss_fn_asks_for_one():
    with pytest.raises(MemfitError, match="loss_fn") as err:
        memfit.estimate(MLP, BATCH)
    _one_line(err)


@pytest.mark.parametrize("kwargs, word", [({"precision": "fp8"}, "precision"), ({"optimizer": "lion"}, "optimizer"),
                                          ({"steps": 0}, "steps"), ({"batch_size": -1}, "batch_size"),
                                          ({"device": "tpu"}, "device"), ({"gpu": "rtx-9999"}, "rtx-4090")])
def test_bad_arguments(kwargs, word):
    with pytest.raises(MemfitError, match=word):
        memfit.estimate(MLP, BATCH, loss_fn=classify, **kwargs)


def test_bad_model_argument():
    with pytest.raises(MemfitError, match="nn.Module"):
        memfit.estimate(42, BATCH)
    with pytest.raises(MemfitError, match="package.module:function"):
        memfit.estimate("nowhere.at_all:build", BATCH)


def test_estimate_leaves_the_users_model_alone():
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memfit.estimate(model, BATCH, loss_fn=classify)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# -- impossible setups are refused, not estimated ---------------------------------------------------

def _tiny_gpt2():
    import transformers as tf

    return tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0,
                         eos_token_id=0)


def _tiny_llama():
    import transformers as tf

    return tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=128, max_position_embeddings=64)


@pytest.mark.parametrize("card", ["t4", "v100-16gb", "v100-32gb"])
def test_bf16_on_a_card_without_it_is_refused(card):
    from memfit.hardware.gpus import gpu

    assert not gpu(card).bf16 and gpu(card).compute_capability < (8, 0)
    for precision in ("bf16-mixed", "bf16"):  # each refused before its trace; the card's fp16 estimate once
        with pytest.raises(MemfitError, match=f"precision={precision} needs bfloat16.*fp16-mixed") as err:
            memfit.estimate(_tiny_llama(), seq_len=8, gpu=card, precision=precision)
        _one_line(err)
    assert memfit.estimate(_tiny_llama(), seq_len=8, gpu=card, precision="fp16-mixed").peak_bytes > 0


def test_plan_for_a_card_without_bf16_never_picks_it():
    from memfit.planner.space import search_space as _space

    class Engine:  # what _space reads
        target = __import__("memfit.hardware.gpus", fromlist=["gpu"]).gpu("t4")
        depth, causal_lm, global_batch_size, has_blocks = 2, True, 2, True

    space = _space(Engine, {"bf16", "lora"}, "adamw")
    assert space and not [r for r in space if "bf16" in r.precision]
    Engine.target = __import__("memfit.hardware.gpus", fromlist=["gpu"]).gpu("a100")
    assert {r.precision for r in _space(Engine, {"bf16"}, "adamw")} == {"fp32", "bf16-mixed", "bf16"}


def test_batch_size_that_disagrees_with_micro_batches_is_refused():
    # refused before any trace (estimator/checks.py step_batch); the two estimates that agree take 2 micro-batches
    # of 3 rows (16 of 2 took ~30 s: a long accumulation is read off traces of 2 and 3 micro-batches)
    with pytest.raises(MemfitError, match="batch_size=6 and micro_batch_size=3 x grad_accum_steps=1 = 3 "
                                          "conflict.*set grad_accum_steps=2,") as err:
        memfit.estimate(_tiny_llama(), seq_len=8, batch_size=6, recipe=memfit.Recipe(micro_batch_size=3))
    _one_line(err)
    consistent = memfit.Recipe(micro_batch_size=3, grad_accum_steps=2)
    same = memfit.estimate(_tiny_llama(), seq_len=8, batch_size=6, recipe=consistent)
    implied = memfit.estimate(_tiny_llama(), seq_len=8, recipe=consistent)  # batch_size left out
    assert same.peak_bytes == implied.peak_bytes > 0


def test_qlora_on_a_model_without_linear_layers_is_refused():
    with pytest.raises(MemfitError, match="qlora found no nn.Linear layers to quantise in GPT2LMHeadModel"):
        memfit.estimate(_tiny_gpt2(), seq_len=8, recipe=memfit.Recipe(lora="qlora:8", precision="bf16-mixed"))


@pytest.mark.parametrize("lora", ["lora:0", "lora:00", "qlora:000", "lora:-1", "lora:x", "off:8", "lora:99999999"])
def test_lora_rank_must_be_a_positive_number(lora):
    with pytest.raises(MemfitError, match="rank from 1 to"):
        memfit.Recipe(lora=lora)


# -- malformed sources: config.json, pkg.mod:fn, huge numbers ------------------------------------

@pytest.mark.parametrize("key, value, needle", [
    ("hidden_size", 0, "hidden_size=0 must be a whole number"), ("num_hidden_layers", [2], "num_hidden_layers"),
    ("vocab_size", 10**30, "vocab_size"), ("hidden_size", "32", "hidden_size.*expected int"),
    ("num_attention_heads", 3, "not a multiple"), ("intermediate_size", 1.5, "intermediate_size.*float"),
    ("tie_word_embeddings", "x", "tie_word_embeddings"),
])
def test_config_json_of_wrong_types_or_sizes(tmp_path, key, value, needle):
    import json

    data = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128, key: value}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(MemfitError, match=needle) as err:
        memfit.estimate(str(tmp_path / "config.json"), seq_len=8)
    _one_line(err)


FACTORIES = """
import torch
NOT_CALLABLE = 3
def raises():
    raise RuntimeError("broken\\non two lines")
def returns_none():
    return None
"""


@pytest.mark.parametrize("spec, needle", [
    ("fuzzy_factories:NOT_CALLABLE", "is a int, not a function"),
    ("fuzzy_factories:raises", "raised RuntimeError: broken on two lines"),
    ("fuzzy_factories:returns_none", "returned NoneType, not an nn.Module"),
    ("fuzzy_factories:missing", "has no 'missing'"), (":", "package.module:function"),
])
def test_factory_sources_that_cannot_build_a_model(tmp_path, monkeypatch, spec, needle):
    (tmp_path / "fuzzy_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MemfitError, match=needle) as err:
        memfit.estimate(spec, torch.randn(2, 8), loss_fn=lambda m, b: m(b).sum())
    _one_line(err)


@pytest.mark.parametrize("kwargs", [{"batch_size": 10**15}, {"seq_len": 10**12}, {"steps": 10**6},
                                    {"micro_batch_size": 1, "grad_accum_steps": 10**9}, {"micro_batch_size": 10**12}])
def test_huge_numbers_are_refused_quickly(kwargs):
    with pytest.raises(MemfitError, match="from 1 to") as err:
        if "micro_batch_size" in kwargs:
            memfit.estimate(_tiny_llama(), recipe=memfit.Recipe.from_dict(kwargs))
        else:
            memfit.estimate(_tiny_llama(), **kwargs)
    _one_line(err)


def test_sizes_that_overflow_64_bits_are_one_line():
    import transformers as tf

    wide = tf.LlamaConfig(hidden_size=2**26, intermediate_size=2**26, num_hidden_layers=1, num_attention_heads=1,
                          num_key_value_heads=1, vocab_size=2**26, max_position_embeddings=2**24)
    with pytest.raises(MemfitError, match="overflow") as err:
        memfit.estimate(wide, seq_len=2**24, batch_size=2**24)
    _one_line(err)


def test_plan_with_a_huge_global_batch_answers_at_once():
    import time

    from memfit.planner.space import divisors as _divisors

    start = time.perf_counter()
    assert _divisors(10**12)[:4] == [1, 2, 4, 5] and len(_divisors(10**12)) == 169
    with pytest.raises(MemfitError, match="global_batch_size must be an integer from 1 to"):
        memfit.plan(_tiny_llama(), budget="1GiB", global_batch_size=10**9)
    assert time.perf_counter() - start < 5


# -- messages and logs ---------------------------------------------------------------------------

def test_messages_are_one_bounded_line():
    from memfit.errors import MAX_MESSAGE

    err = MemfitError("first\nsecond\t" + "x" * 10_000 + " the fix")
    assert "\n" not in str(err) and len(str(err)) <= MAX_MESSAGE
    assert str(err).startswith("first second") and str(err).endswith("the fix")
    with pytest.raises(MemfitError) as caught:
        memfit.estimate("y" * 100_000)
    assert len(_one_line(caught)) <= MAX_MESSAGE


def test_torch_fake_tensor_log_is_silenced_during_a_trace_and_restored(capfd):
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    seen = []

    class Record(logging.Handler):
        def emit(self, record):
            seen.append(record)

    handler = Record()
    log.addHandler(handler)
    try:
        with pytest.raises(MemfitError, match="overflow"):
            # a shape that fails inside a meta kernel: torch logs it with a traceback, then raises
            memfit.estimate(_tiny_llama(), torch.zeros(1, 1, dtype=torch.long).expand(2**31, 2**31),
                            loss_fn=lambda m, b: m(input_ids=b[:, :4]).logits.sum() + b.float().tril().sum())
        assert not seen and "Traceback" not in capfd.readouterr().err
        assert log.disabled is False  # restored after the trace
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(), pytest.raises(RuntimeError):  # and outside memfit it logs as before
            torch.zeros(1, 1).expand(2**31, 2**31).tril()
        assert seen
    finally:
        log.removeHandler(handler)


def _raising_loss(model, batch):
    model(batch[0])
    raise ValueError("my loss broke")


def _raising_factory():
    raise RuntimeError("factory broke")


def _raising_batch():
    raise KeyError("batch broke")


@pytest.mark.parametrize("call, needle", [
    (lambda: memfit.estimate(MLP, BATCH, loss_fn=_raising_loss), "the step raised ValueError at "),
    (lambda: memfit.estimate(_raising_factory, BATCH, loss_fn=classify), "the model factory"),
    (lambda: memfit.estimate(MLP, _raising_batch, loss_fn=classify), "making the batch failed"),
])
def test_the_users_own_function_raising_is_one_line_naming_its_file_and_line(call, needle):
    """A loss function, a model factory or a batch function of the user's raising inside the trace: one line that
    names where in their file (a raising loss function printed memfit's traceback and exited 1 once)."""
    with pytest.raises(MemfitError) as err:
        call()
    text = _one_line(err)
    assert needle in text and "test_errors.py:" in text, text


@pytest.mark.parametrize("architectures", ["LlamaForCausalLM", [1, 2], {"a": 1}])
def test_architectures_that_are_not_a_list_of_class_names_are_refused(tmp_path, architectures):
    """The head is read from ``architectures``: a string or numbers there picked none, silently (a fuzz found it)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=architectures, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=128)))
    with pytest.raises(MemfitError) as err:
        memfit.estimate(str(tmp_path), batch_size=1, seq_len=16, device="cpu")
    assert "architectures=" in _one_line(err) and "list of class names" in str(err.value)
