"""What a CUDA process holds outside torch's caching allocator, library by library, and cuDNN's workspaces.

    python -m bench cuda_outside --out DIR     # on a machine with one CUDA GPU -> DIR/cuda-outside-<card>.json
    python -m bench cuda_outside               # without a GPU: says so and exits 0

Issue 37's measurements, made in one fresh process on an otherwise idle GPU. After each step it reads
what the driver says the device holds (``cudaMemGetInfo``: total - free), what NVML says this process
holds (what nvidia-smi prints), and torch's reserved and allocated bytes; *outside* = device used -
reserved. The steps, in order, each adding what its library loads the first time it is used: CUDA's
context (``torch.cuda.init`` and a 1-element tensor), a first fp32 matmul (cuBLAS handle + workspace), a
bf16 matmul (cuBLASLt), an fp16 matmul, SDPA (flash and memory-efficient), a convolution forward and
backward (cuDNN handle, its engines), an LSTM (cuDNN RNN), an NCCL communicator of world size 1 and an
all-reduce, and an Inductor/Triton kernel (``torch.compile``). Then cuDNN's workspaces (benchmark off, as
torch defaults): each convolution's forward, input-gradient and weight-gradient call (``aten.convolution``,
``aten.convolution_backward``) run alone, its workspace = the allocator's peak during the call - what was
allocated before - the bytes of its outputs. Shapes: ViT-L/16's patch embedding at batch 1-64 and
ResNet-50's convolutions at batch 32, in fp32, bf16 and fp32 with TF32 off.

Written by hand because no library reports these: torch's allocator sees only its own segments, and
the libraries allocate their handles and module images through the driver directly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
from bench import _results  # noqa: E402
RESULTS = "cuda-outside-<card>.json"

MiB = 2 ** 20
# (name, N, C_in, H=W, C_out, kernel, stride, padding)
CONVS = [(f"vit-l16-patch-b{b}", b, 3, 224, 1024, 16, 16, 0) for b in (1, 8, 32, 64)] + [
    ("resnet50-conv1-b32", 32, 3, 224, 64, 7, 2, 3),
    ("resnet50-3x3-64-b32", 32, 64, 56, 64, 3, 1, 1),
    ("resnet50-1x1-256-b32", 32, 256, 56, 64, 1, 1, 0),
    ("resnet50-3x3-128-b32", 32, 128, 28, 128, 3, 1, 1),
    ("resnet50-3x3-256-b32", 32, 256, 14, 256, 3, 1, 1),
    ("resnet50-3x3-512-b32", 32, 512, 7, 512, 3, 1, 1),
]


def _nvml_process(pid: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid:
                return p.usedGpuMemory
        return None
    except Exception:  # noqa: BLE001 - NVML absent or the pid unseen (containers): recorded as None
        return None


def reading(label: str) -> dict:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    return {"step": label, "device_used": total - free, "nvml_process": _nvml_process(os.getpid()),
            "reserved": reserved, "allocated": allocated, "outside": total - free - reserved}


def library_steps() -> list[dict]:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    rows = []
    free, total = torch.cuda.mem_get_info()  # initialises the context too: the first reading is the context
    torch.empty(1, device=dev)
    rows.append(reading("context"))
    a = torch.randn(1024, 1024, device=dev)
    (a @ a).sum().item()
    rows.append(reading("fp32 matmul (cuBLAS)"))
    b = a.bfloat16()
    (b @ b).float().sum().item()
    rows.append(reading("bf16 matmul (cuBLASLt)"))
    h = a.half()
    (h @ h).float().sum().item()
    rows.append(reading("fp16 matmul"))
    q = torch.randn(2, 16, 1024, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    rows.append(reading("SDPA bf16 (flash)"))
    q32 = torch.randn(2, 16, 1024, 64, device=dev, requires_grad=True)
    F.scaled_dot_product_attention(q32, q32, q32, is_causal=True).sum().backward()
    rows.append(reading("SDPA fp32 (memory-efficient)"))
    x = torch.randn(8, 64, 56, 56, device=dev, requires_grad=True)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1, device=dev)
    conv(x).sum().backward()
    rows.append(reading("conv2d fp32 fwd+bwd (cuDNN)"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        conv(x).float().sum().backward()
    rows.append(reading("conv2d bf16 fwd+bwd"))
    lstm = torch.nn.LSTM(256, 256, num_layers=2, device=dev)
    lstm(torch.randn(32, 8, 256, device=dev))[0].sum().backward()
    rows.append(reading("LSTM (cuDNN RNN)"))
    del a, b, h, q, q32, x, conv, lstm
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(1024, device=dev)
    dist.all_reduce(t)
    rows.append(reading("NCCL world 1 + all_reduce"))
    dist.destroy_process_group()
    rows.append(reading("NCCL destroyed"))

    @torch.compile
    def fused(u):
        return (u.sin() * 2 + u.cos()).relu()

    fused(torch.randn(4096, device=dev)).sum().item()
    rows.append(reading("Inductor/Triton kernel"))
    torch.cuda.empty_cache()
    rows.append(reading("after empty_cache"))
    return rows


def _outputs_bytes(out) -> int:
    import torch

    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes()
    if isinstance(out, (tuple, list)):
        return sum(_outputs_bytes(o) for o in out if o is not None)
    return 0


def _workspace(fn) -> tuple[int, int]:
    """(peak - before - outputs, outputs) of one call; the caching allocator is warm (blocks reused)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    size = _outputs_bytes(out)
    del out
    return peak - before - size, size


def conv_workspaces() -> list[dict]:
    import torch

    aten = torch.ops.aten
    torch.backends.cudnn.benchmark = False
    rows = []
    for mode in ("fp32", "bf16", "fp32-no-tf32"):
        torch.backends.cudnn.allow_tf32 = mode != "fp32-no-tf32"
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        for name, n, c, hw, k, ks, stride, pad in CONVS:
            x = torch.randn(n, c, hw, hw, device="cuda", dtype=dtype)
            w = torch.randn(k, c, ks, ks, device="cuda", dtype=dtype)
            args = ([stride, stride], [pad, pad], [1, 1], False, [0, 0], 1)
            fwd = lambda: aten.convolution(x, w, None, *args)  # noqa: E731
            fwd()  # warm: cuDNN's engine, the allocator's blocks
            ws_f, out_f = _workspace(fwd)
            y = fwd()
            g = torch.randn_like(y)
            del y
            row = {"conv": name, "mode": mode, "input": list(x.shape), "weight": list(w.shape),
                   "forward": ws_f, "output_bytes": out_f}
            for part, mask in (("input_grad", [True, False, False]), ("weight_grad", [False, True, False])):
                call = lambda: aten.convolution_backward(g, x, w, None, *args, mask)  # noqa: E731
                call()
                row[part], _ = _workspace(call)
            rows.append(row)
            print(f"{name:24} {mode:13} workspace fwd {row['forward'] / MiB:8.1f} MiB  dgrad "
                  f"{row['input_grad'] / MiB:8.1f}  wgrad {row['weight_grad'] / MiB:8.1f}", flush=True)
            del x, w, g
            torch.cuda.empty_cache()
    torch.backends.cudnn.allow_tf32 = True
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(_results.DIR))
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("cuda_outside: no CUDA GPU visible to torch: skipped (run it on a machine with one)")
        return
    from memfit.hardware.gpus import visible_gpu

    started = time.perf_counter()
    steps = library_steps()
    for r in steps:
        print(f"{r['step']:30} device {r['device_used'] / MiB:9.1f} MiB  outside {r['outside'] / MiB:8.1f} MiB  "
              f"nvml {'-' if r['nvml_process'] is None else round(r['nvml_process'] / MiB, 1)}", flush=True)
    card = visible_gpu()
    meta = {"card": getattr(card, "name", None), "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "nccl": str(torch.cuda.nccl.version()), "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "cublaslt_workspace_size": os.environ.get("CUBLASLT_WORKSPACE_SIZE")}
    path = os.path.join(args.out, f"cuda-outside-{meta['card'] or 'gpu'}.json")
    _results.write(path, _results.tables(library_steps=steps), **meta)  # the library steps kept if the convs fail
    convs = conv_workspaces()
    _results.write(path, _results.tables(library_steps=steps, conv_workspaces=convs), **meta,
                   seconds=round(time.perf_counter() - started, 1))
    print("->", path)


if __name__ == "__main__":
    main()
