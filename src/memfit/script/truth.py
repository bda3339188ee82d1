"""Independent truth for a script's estimate on CPU: the script run for real, the CPU allocator's own events.

The same script, the same arguments, on real CPU tensors under ``torch.profiler`` with ``profile_memory``
(``estimator/truth.allocator_peak``), stopped after the same number of optimizer steps by torch's global
optimizer step hook. It shares nothing with the ledger, the fake tensors or the device shim: what the tests
and ``bench/scripts.py`` grade ``estimate_script(..., device="cpu")`` against.
"""

from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_post_hook

from memfit.estimator.truth import allocator_peak
from memfit.script.device import cuda_hidden, forget_devices
from memfit.script.runner import run, target as make_target

__all__ = ["script_peak"]


class _Stop(BaseException):
    pass


def script_peak(path, argv=(), *, module: bool = False, steps: int = 2) -> tuple[int, int]:
    """(the highest bytes the CPU allocator held above its level at the start, optimizer steps run) while the
    script runs for real on the CPU (``torch.cuda.is_available()`` answers False, as on a CPU-only machine),
    stopped after ``steps`` optimizer steps (0: to its end)."""
    what = make_target(path, argv, module=module)
    seen = [0]

    def counted(optimizer, args, kwargs):
        seen[0] += 1
        if steps and seen[0] >= steps:
            raise _Stop

    def body():
        forget_devices()
        handle = register_optimizer_step_post_hook(counted)
        try:
            with cuda_hidden():
                run(what)
        except _Stop:
            pass
        finally:
            handle.remove()
            forget_devices()

    return allocator_peak(body), seen[0]
