"""What a CUDA process holds outside torch's allocator (hardware/outside.py), term by term, against the H200
figures it was measured from; cuDNN's convolution workspaces (hardware/cuda.conv_workspaces); the report's
split between the allocator and the rest."""

import json
import os

import pytest
import torch

import memfit
from memfit.hardware.cuda import conv_workspaces
from memfit.hardware.gpus import gpu
from memfit.hardware.outside import EAGER_CONTEXT, Workload, outside

MiB = 2 ** 20
RESULTS = os.path.join(os.path.dirname(__file__), "..", "bench", "results")


def _measured():
    with open(os.path.join(RESULTS, "cuda-outside-h200.json")) as f:
        steps = {s["step"]: s for s in json.load(f)["rows"] if s["part"] == "library_steps"}
    with open(os.path.join(RESULTS, "gpu-check-h200-truths.json")) as f:
        truths = {r["name"]: r for r in json.load(f)["rows"]}
    return steps, truths


def _term(found, name):
    return next(t for t in found.terms if t.name.startswith(name))


def test_context_is_the_measured_h200_figure_and_the_catalog_elsewhere():
    steps, _ = _measured()
    h200 = outside(gpu("h200"))
    assert _term(h200, "CUDA context").bytes == steps["context"]["outside"] == gpu("h100-sxm").cuda_context_bytes
    assert _term(h200, "CUDA context").measured
    ada = _term(outside(gpu("rtx-4090")), "CUDA context")
    assert ada.bytes == gpu("rtx-4090").cuda_context_bytes == 426 * MiB and "gpus.py" in ada.source


def test_cublas_term_is_what_the_first_matmul_added():
    steps, _ = _measured()
    added = steps["fp32 matmul (cuBLAS)"]["outside"] - steps["context"]["outside"]
    assert _term(outside(gpu("h200")), "cuBLAS").bytes == added == 165_675_008
    # the bf16 (cuBLASLt) and fp16 matmuls after it added nothing
    assert steps["bf16 matmul (cuBLASLt)"]["outside"] == steps["fp16 matmul"]["outside"] == steps["fp32 matmul (cuBLAS)"]["outside"]
    assert not any(t.name.startswith("cuBLAS") for t in outside(gpu("h200"), Workload(matmul=False)).terms)


def test_a_training_process_is_what_the_h200_truths_held():
    _, truths = _measured()
    found = outside(gpu("h200"))
    bf16 = [t["outside_allocator_now"] for name, t in truths.items()
            if t.get("outside_allocator_now") and name in ("llama1b-bf16-mixed", "qwen06b-bf16", "qwen06b-fp16-scaler",
                                                            "llama1b-ckpt", "llama3b-lora", "cnn-fp32", "llama1b-fused")]
    assert len(bf16) == 7 and set(bf16) == {found.bytes} == {804_061_184}
    fp32 = truths["llama1b-fp32"]["outside_allocator_now"]
    moe = truths["qwen3moe-4l"]["outside_allocator_now"]
    assert found.low == fp32 and found.high == moe  # the range is the spread of the recorded training runs


def test_a_generating_process_is_what_the_h200_generations_held():
    _, truths = _measured()
    found = outside(gpu("h200"), Workload(kind="generate"))
    assert found.bytes == truths["generate-llama1b"]["outside_allocator_now"]
    assert found.low == truths["generate-qwen8b"]["outside_allocator_now"]


def test_nccl_at_world_size_one_is_the_fsdp2_truth_and_peers_count_the_eager_communicator():
    _, truths = _measured()
    steps, _ = _measured()
    world1 = outside(gpu("h200"), Workload(communicators=1))
    assert world1.bytes == truths["fsdp-llama1b"]["outside_allocator_now"]
    offload = outside(gpu("h200"), Workload(communicators=1, offload=True))
    assert offload.bytes == truths["fsdp-offload-llama3b"]["outside_allocator_now"]
    eager = steps["NCCL world 1 + all_reduce"]["outside"] - steps["LSTM (cuDNN RNN)"]["outside"]
    peers = outside(gpu("h200"), Workload(communicators=2, world_size=8))
    nccl = _term(peers, "NCCL")
    assert nccl.bytes == 2 * eager and nccl.high is None and peers.high is None  # the channels' buffers: unmeasured
    assert "2 communicators" in nccl.name


def test_eager_loading_and_a_measured_context():
    eager = outside(gpu("v100-16gb"), Workload(eager_loading=True))
    assert _term(eager, "CUDA context").bytes == EAGER_CONTEXT == 1343 * MiB and eager.high is None
    mine = outside(gpu("v100-16gb"), Workload(context_bytes=700 * MiB))
    assert _term(mine, "CUDA context").bytes == 700 * MiB
    with pytest.raises(ValueError, match="'train' or 'generate'"):
        outside(gpu("h200"), Workload(kind="serve"))


def test_other_cards_say_the_library_terms_are_assumed():
    found = outside(gpu("a100-80gb"))
    assert not _term(found, "cuBLAS").measured and "assumed for the a100-80gb" in _term(found, "cuBLAS").source
    assert all(t.measured for t in outside(gpu("h100-sxm")).terms)
    assert json.dumps(found.to_dict())


def test_the_card_capacity_is_its_memory_less_a_training_process_outside():
    card = gpu("rtx-4090")
    assert card.outside_bytes == outside(card).bytes > card.cuda_context_bytes
    assert card.usable_bytes() == card.memory_bytes - card.outside_bytes


# -- cuDNN convolution workspaces ---------------------------------------------------------------------------------

def _conv(n, c, hw, out_c, k, stride, pad, dtype=torch.float32):
    x = torch.empty(n, c, hw, hw, dtype=dtype, device="meta")
    w = torch.empty(out_c, c, k, k, dtype=dtype, device="meta")
    args = (x, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1)
    out = torch.ops.aten.convolution.default(*args)
    return x, w, out, args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_workspaces_are_twice_what_each_call_writes(dtype):
    x, w, out, args = _conv(32, 64, 56, 64, 3, 1, 1, dtype)
    assert conv_workspaces(torch.ops.aten.convolution.default, args, out) == [2 * out.numel() * out.element_size()]
    back = (out, x, w, [64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    sizes = conv_workspaces(torch.ops.aten.convolution_backward.default, back, None)
    assert sizes == [2 * x.numel() * x.element_size(), 2 * out.numel() * out.element_size()]
    no_input_grad = back[:10] + ([False, True, True],)  # the first layer: no gradient for the image
    assert conv_workspaces(torch.ops.aten.convolution_backward.default, no_input_grad, None) == sizes[1:]


def test_conv_workspace_rule_against_the_h200_measurements():
    with open(os.path.join(RESULTS, "cuda-outside-h200.json")) as f:
        rows = [r for r in json.load(f)["rows"] if r["part"] == "conv_workspaces" and r["mode"] in ("fp32", "bf16")]
    measured = rule = 0
    for r in rows:
        n, c, hw, _ = r["input"]
        out_c, _, k, _ = r["weight"]
        stride = {16: 16, 7: 2}.get(k, 1)
        x, w, out, args = _conv(n, c, hw, out_c, k, stride, k // 2 if k in (3, 7) else 0,
                                torch.bfloat16 if r["mode"] == "bf16" else torch.float32)
        assert out.numel() * out.element_size() == r["output_bytes"]
        fwd = conv_workspaces(torch.ops.aten.convolution.default, args, out)
        back = conv_workspaces(torch.ops.aten.convolution_backward.default,
                               (out, x, w, [out_c], args[3], args[4], [1, 1], False, [0, 0], 1, [True, True, False]),
                               None)
        measured += r["forward"] + r["input_grad"] + r["weight_grad"]
        rule += sum(fwd) + sum(back)
        if k == 1:
            assert fwd == back == []  # 1x1: GEMM engines; measured 0-2 MiB
    assert len(rows) == 20 and abs(rule - measured) / measured < 0.06  # 1,720 vs 1,639 MiB


def test_grouped_and_1x1_convolutions_take_no_workspace():
    x = torch.empty(8, 32, 16, 16, device="meta")
    w = torch.empty(32, 1, 3, 3, device="meta")  # depthwise
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 32)
    out = torch.ops.aten.convolution.default(*args)
    assert conv_workspaces(torch.ops.aten.convolution.default, args, out) == []
    assert conv_workspaces(torch.ops.aten.mm.default, (x, x), x) == []


def test_a_cnn_estimate_holds_the_workspaces_and_says_what_is_outside():
    """The zoo's CNN on the H200: reserved and the device's bytes equal gpu_check's recorded truth (one run, a
    fresh process: bench/results/gpu-check-h200-truths.json 'cnn-fp32'); without the workspaces reserved was
    21.7 % low."""
    from memfit.models.zoo import CASES

    build, batch, loss = CASES["cnn"]
    _, truths = _measured()
    truth = truths["cnn-fp32"]
    torch.manual_seed(0)
    report = memfit.estimate(build, batch() if callable(batch) else batch, loss_fn=loss, gpu="h200")
    assert report.reserved_bytes == truth["reserved"]
    assert report.device_bytes == truth["reserved"] + truth["outside_allocator_now"]
    assert abs(report.peak_bytes - truth["allocated"]) / truth["allocated"] < 0.035
    line = report.device_line()
    assert "(torch's allocator) + outside it 766.81 MiB (CUDA context 526.81 MiB, cuBLAS/cuBLASLt 158.00 MiB" in line
    data = report.to_dict()
    assert data["outside_bytes"] == 804_061_184 and data["device_bytes"] == report.device_bytes
    assert [t["name"] for t in data["outside"]["terms"]] == ["CUDA context", "cuBLAS/cuBLASLt", "step kernels"]


def test_a_rank_counts_one_communicator_per_process_group_with_peers():
    from memfit.estimator.verdict import run_outside
    from memfit.techniques.recipe import Recipe

    card = gpu("h200")
    alone = run_outside(card, Recipe(), 1)
    assert alone.bytes == card.outside_bytes and not any(t.name.startswith("NCCL") for t in alone.terms)
    fsdp = run_outside(card, Recipe(parallel="fsdp"), 8)
    assert _term(fsdp, "NCCL").bytes == 587_202_560 and fsdp.bytes == card.outside_bytes + 587_202_560
    mesh = run_outside(card, Recipe(parallel="fsdp", tp=2, pp=2), 8)
    assert _term(mesh, "NCCL").name == "NCCL (3 communicators)"
    world1 = run_outside(card, Recipe(parallel="fsdp"), 1)
    assert _term(world1, "NCCL").bytes == 73_465_856  # FSDP2 at world size 1: the lazily made communicator
