"""What torchao's compiled 8-bit AdamW step allocates per parameter value, measured on the CPU allocator under the
torch and torchao that run it: the fact behind the torchtune 8-bit AdamW row of ``published.py``.

    python -m bench torchao_step                           # this environment's torch and torchao
    /tmp/v25/bin/python bench/published/torchao_step.py    # another one (below); merged into the results file

torchtune's table (1814feb17, November 2024) ran torch 2.5 and torchao 0.6.1, whose ``AdamW8bit`` cannot step a
bf16 parameter on torch 2.13 (its fp32 state ``lerp``s the bf16 gradient, which 2.13's dtype check refuses), so
memfit, which traces with the torch it runs on, cannot see that stack's step. This runs the real compiled step
(Inductor, C++ on the CPU) on one bf16 parameter of 4096 x 3072 values, three steps, and records the allocator's
signed allocations of the last one in bytes per parameter value (the profiler's kineto event tree, read by
``memfit.accounting.allocator_events``, loaded from its file: memfit itself need not import on an old torch).
Measured so far (``bench/results/torchao-step-cpu.json``):

- torch 2.13 + torchao 0.18, and torchao 0.6.1's own step on torch 2.13 (fp32): two fp32 moments, 8 B/value at
  the peak: what ``memfit/techniques/_lowbit.py`` models.
- torch 2.5.1 + torchao 0.6.1 (bf16 and fp32 parameters alike): an fp32 buffer of the parameter's shape first (the
  update ``-lr*wd*p - step_size*exp_avg/denom`` that 0.6.1 adds in place to the parameter it reads), then the two
  moments: 12 B/value. torch 2.5's Inductor, not torchao's code: the same 0.6.1 step on 2.13 holds 8.

``replayed(stack)`` makes memfit's fake step allocate a measured stack's program instead of today's
(``published.py`` uses it for a row whose run had that stack). Left out: CUDA's (Triton) kernels were not measured;
the CPU program is taken for the card, as ``_lowbit.py`` takes its own. Parameters under 4096 values (plain moments)
are not replayed: their update is fused in both stacks' CPU kernels at the sizes tried, and they are small.

An old stack, off the project's own environment (package registries only; PyPI's torch 2.5.1 wheel with its CUDA
libraries, which import on a CPU-only machine):
``python3.11 -m venv /tmp/v25 && /tmp/v25/bin/pip install torch==2.5.1 torchao==0.6.1 numpy``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import sys

RESULTS = ("torchao-step-cpu.json",)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # bench/ a package when run as a file (from an old stack's venv too)

from bench import _results  # noqa: E402  (standard library only: imports on any torch)
ROWS, COLS, STEPS = 4096, 3072, 3


def _allocator_events():
    """``memfit.accounting.allocator_events`` loaded from its file alone: importing the package would import all of
    memfit, which need not run on an old torch; that module needs only torch's profiler."""
    import importlib.util

    path = os.path.join(ROOT, "src", "memfit", "accounting", "allocator_events.py")
    spec = importlib.util.spec_from_file_location("memfit_allocator_events", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(dtype_name: str = "bfloat16") -> dict:
    """The last of ``STEPS`` compiled steps of ``AdamW8bit`` on one parameter, per value."""
    import torch
    import torchao
    from torch.profiler import ProfilerActivity, profile

    try:
        from torchao.optim import AdamW8bit
    except ImportError:  # torchao before 0.11 kept it under prototype
        from torchao.prototype.low_bit_optim import AdamW8bit

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    param = torch.nn.Parameter(torch.randn(ROWS, COLS, dtype=dtype))
    optimizer = AdamW8bit([param], lr=1e-3)
    for _ in range(STEPS):
        param.grad = torch.randn(ROWS, COLS, dtype=dtype)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            optimizer.step()
        param.grad = None
    events = _allocator_events()
    sizes = [size for size in events.allocation_sizes(*prof.profiler.kineto_results.experimental_event_tree())
             if abs(size) >= 1024]  # the step's tensors, not its scalars
    peak, _ = events.span(sizes)
    values = ROWS * COLS
    return {"stack": f"torch {torch.__version__.split('+')[0]}, torchao {torchao.__version__}",
            "torch": torch.__version__, "torchao": torchao.__version__, "dtype": dtype_name, "values": values,
            "program_bytes_per_value": [size / values for size in sizes], "peak_bytes_per_value": peak / values,
            "device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "date": datetime.date.today().isoformat()}


def measured(stack: str, dtype_name: str = "bfloat16") -> dict:
    """The results file's row for ``stack`` (e.g. "torch 2.5.1, torchao 0.6.1") and parameter dtype."""
    rows = _results.read(RESULTS[0])["rows"]
    return next(row for row in rows if row["stack"] == stack and row["dtype"] == dtype_name)


@contextlib.contextmanager
def replayed(stack: str):
    """While open, memfit's fake 8-bit torchao step allocates the program measured for ``stack`` (a key of the
    results file, e.g. "torch 2.5.1, torchao 0.6.1"), scaled to each quantised parameter's size, in its order."""
    from unittest import mock

    from memfit.techniques import _lowbit

    program = measured(stack)["program_bytes_per_value"]
    todays = _lowbit._kernel_standin

    def standin(p, grad, step, exp_avg, exp_avg_sq, *args, **kwargs) -> None:
        if type(exp_avg).__name__ != "OptimState8bit":
            return todays(p, grad, step, exp_avg, exp_avg_sq, *args, **kwargs)
        live: list = []
        for per_value in program:
            size = round(abs(per_value) * p.numel())
            if per_value > 0:  # new_empty from the parameter: the ledger gives the buffer the parameter's owner
                live.append(p.new_empty(size, dtype=_lowbit.torch.uint8))
            else:  # the latest live buffer of this size
                live.pop(max(i for i, t in enumerate(live) if t.numel() == size))

    with mock.patch.object(_lowbit, "_kernel_standin", standin):
        yield


def main() -> None:
    import torch
    import torchao

    stack = f"torch {torch.__version__.split('+')[0]}, torchao {torchao.__version__}"
    path = _results.path(RESULTS[0])
    kept = [row for row in _results.read(RESULTS[0])["rows"] if row["stack"] != stack] if path.exists() else []
    for dtype_name in ("bfloat16", "float32"):
        try:
            found = measure(dtype_name)
        except Exception as err:  # noqa: BLE001 torchao 0.6.1 on torch 2.13 cannot step a bf16 parameter: recorded
            found = {"stack": stack, "dtype": dtype_name, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
            print(f"{stack} {dtype_name}: {found['error']}")
        else:
            print(f"{stack} {dtype_name}: peak {found['peak_bytes_per_value']:.3f} B/value, program "
                  f"{[round(x, 4) for x in found['program_bytes_per_value']]}")
        kept.append(found)
    summary = {f"{row['stack']}, {row['dtype']}": row.get("peak_bytes_per_value", row.get("error")) for row in kept}
    print(f"wrote {_results.write(RESULTS[0], kept, summary, note='each row from its own environment')}")


if __name__ == "__main__":
    main()
