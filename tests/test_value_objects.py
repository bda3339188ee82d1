"""``Hardware`` and ``Data`` (``estimator/inputs.py``): the same answers as the keywords they gather, their
own checks as one line naming the fix, and a value given both ways that differs as one error."""

import dataclasses

import pytest
import transformers as tf

import memfit
from memfit import Data, Hardware, MemfitError, estimate, estimate_micro_batch, fit, plan
from memfit.hardware.gpus import GPU
from memfit.planner.cache import EngineCache

TINY = "examples/tiny-llama/config.json"  # 4 layers of 128: a second a trace on the CPU
GPU_NAME = "rtx-4090"
GIB = 2**30
CACHE = EngineCache()  # plan's and fit's two calls share their traces


def _same(a, b) -> None:
    assert a.to_dict() == b.to_dict()


def test_the_objects_are_exported_and_frozen():
    assert memfit.Hardware is Hardware and memfit.Data is Data
    with pytest.raises(dataclasses.FrozenInstanceError):
        Hardware().budget = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        Data().batch_size = 1


def test_hardware_reads_sizes_and_names_its_card():
    where = Hardware(gpu=GPU_NAME, budget="20GiB", gpus=2)
    assert where.budget == 20 * GIB and isinstance(where.gpu, GPU) and where.gpu.name == GPU_NAME
    assert where == Hardware(gpu=where.gpu, budget=20 * GIB, gpus=2)
    assert Hardware(budget="24GB").budget == 24 * 10**9
    assert "rtx-4090" in repr(where) and len(repr(where)) < 100  # the card by name, not its catalog entry
    assert Hardware(device="cpu").on_cpu and not Hardware().on_cpu
    assert Data(lengths=[3, 4]).lengths == (3, 4)  # a list is kept as a tuple: frozen all the way down


@pytest.mark.parametrize("make, needle", [
    (lambda: Data(batch_size=-4), "batch_size must be an integer from 1"),
    (lambda: Data(batch_size=True), "batch_size must be an integer"),
    (lambda: Data(seq_len=0), "seq_len must be an integer from 1"),
    (lambda: Data(packed="yes"), "packed must be True or False"),
    (lambda: Data(lengths=3.5), "lengths must be a list of token counts"),
    (lambda: Hardware(budget="24 gigs"), "write it like 24GiB"),
    (lambda: Hardware(budget=-1), "must be positive"),
    (lambda: Hardware(gpu="no-such-card"), "no-such-card"),
    (lambda: Hardware(gpu=3), "gpu must be a catalog name"),
    (lambda: Hardware(gpu=GPU_NAME, device="cpu"), "conflict: drop one"),
    (lambda: Hardware(device="tpu"), "use device='cpu', 'cuda' or 'mps'"),
    (lambda: Hardware(gpus=0), "gpus must be an integer from 1"),
    (lambda: Hardware(nodes=2), "needs gpus="),
    # the same checks of the keywords they gather, where 0 is a value given (and wrong), not left out
    (lambda: estimate(TINY, budget=0), "must be positive"),
    (lambda: estimate(TINY, gpus=0), "gpus must be an integer from 1"),
    (lambda: estimate(TINY, batch_size=0), "batch_size must be an integer from 1"),
])
def test_each_object_checks_its_fields_in_one_line(make, needle):
    with pytest.raises(MemfitError, match=needle) as caught:
        make()
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("call, needle", [
    (lambda: estimate(TINY, data=Data(batch_size=2), batch_size=4), r"batch_size=4 and data.batch_size=2 conflict"),
    (lambda: estimate(TINY, data=Data(seq_len=32), seq_len=64), r"seq_len=64 and data.seq_len=32 conflict"),
    (lambda: estimate(TINY, hardware=Hardware(device="cpu"), gpu=GPU_NAME), r"gpu='rtx-4090' and hardware.gpu=None"),
    (lambda: estimate(TINY, hardware=Hardware(budget="20GiB"), budget="10GiB"), r"budget='10GiB' and hardware.budget"),
    (lambda: estimate(TINY, hardware="cpu"), r"hardware must be a memfit.Hardware"),
    (lambda: estimate(TINY, data={"batch_size": 2}), r"data must be a memfit.Data"),
    (lambda: plan(TINY, data=Data(batch_size=8), global_batch_size=16, budget="1GiB"),
     r"global_batch_size=16 and data.batch_size=8 conflict"),
    (lambda: plan(TINY, global_batch_size=-1, budget="1GiB"), r"^global_batch_size must be an integer from 1"),
    (lambda: plan(TINY, data=Data(batch_size=8, packed=True, seq_len=32), budget="1GiB"), r"drop lengths and packed"),
    (lambda: fit(TINY, data=Data(batch_size=8), budget="1GiB"), r"fit searches the batch size"),
    (lambda: estimate_micro_batch(TINY, 2, 32, data=Data()), r"drop data="),
])
def test_a_value_given_both_ways_that_differs_is_one_error(call, needle):
    with pytest.raises(MemfitError, match=needle) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_estimate_on_the_cpu_is_the_same_either_way():
    _same(estimate(TINY, device="cpu", batch_size=2, seq_len=32),
          estimate(TINY, hardware=Hardware(device="cpu"), data=Data(batch_size=2, seq_len=32)))


def test_estimate_on_a_card_under_a_budget_is_the_same_either_way():
    old = estimate(TINY, gpu=GPU_NAME, budget="20GiB", batch_size=2, seq_len=32)
    new = estimate(TINY, hardware=Hardware(gpu=GPU_NAME, budget=20 * GIB), data=Data(batch_size=2, seq_len=32))
    _same(old, new)
    assert new.verdict == "fits" and new.settings["target"] == "given"
    # the same value given both ways is no conflict ("20GiB" is 20 GiB)
    _same(new, estimate(TINY, hardware=Hardware(gpu=GPU_NAME, budget=20 * GIB), budget="20GiB",
                        data=Data(batch_size=2, seq_len=32), batch_size=2))


def test_variable_length_data_is_the_same_either_way():
    lengths = [12, 30, 7, 25]
    old = estimate(TINY, device="cpu", batch_size=2, seq_len=32, lengths=lengths, packed=True)
    new = estimate(TINY, hardware=Hardware(device="cpu"), data=Data(batch_size=2, seq_len=32, lengths=lengths,
                                                                      packed=True))
    _same(old, new)
    assert new.micro_batch is not None


def _config():
    return tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                          architectures=["LlamaForCausalLM"])


def test_plan_and_fit_are_the_same_either_way():
    config = _config()
    # the graph's axes fixed (one graph trace; what is compared is what each way hands the search)
    narrow = {"precision": "bf16-mixed", "checkpointing": "off", "offload_activations": False, "chunked_loss": 0}
    old = plan(config, gpu=GPU_NAME, budget="2GiB", global_batch_size=8, seq_len=64, cache=CACHE, fixed=narrow)
    new = plan(config, hardware=Hardware(gpu=GPU_NAME, budget="2GiB"), data=Data(batch_size=8, seq_len=64),
               cache=CACHE, fixed=narrow)
    assert new.best == old.best and new.budget == old.budget == 2 * GIB and new.gpu == old.gpu == GPU_NAME
    old = fit(config, gpu=GPU_NAME, budget="1GiB", seq_len=64, cache=CACHE, limit=64)
    new = fit(config, hardware=Hardware(gpu=GPU_NAME, budget="1GiB"), data=Data(seq_len=64), cache=CACHE, limit=64)
    assert dataclasses.replace(new, seconds=0, traces=0) == dataclasses.replace(old, seconds=0, traces=0)
