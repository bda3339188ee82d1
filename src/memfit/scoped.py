"""Changes to torch (and the process) that memfit makes only while a trace runs, undone on exit.

Every change memfit makes to state it does not own is one of these context managers, entered for
the duration of a trace or a measurement and restored exactly on exit, exceptions included:

* ``patched(owner, name, value)``: a module or class attribute (``torch.get_rng_state`` in the
  ledger, ``torch.nn.functional.scaled_dot_product_attention`` under CUDA semantics,
  ``torch.nn.Module.to`` while LoRA wraps a fake model, transformers' Mamba scan).
* ``quiet_profiler()``: ``KINETO_LOG_LEVEL`` while a profiler starts (kernel-scratch probes,
  ``memfit.measure``). Kineto prints two lines to stderr each time a profiler starts; it reads the
  variable once, at the first start in the process, and keeps that level: a level set by an earlier
  profiler of the process stays (memfit cannot change it), and the level set at memfit's first
  start stays after the variable is restored (kineto has no call to reset it). A variable the user
  set is left as it is.

Dispatcher registrations (``torch.library.Library(..., "IMPL")`` in ``hardware/cuda.py``) are made
on enter and ``_destroy()``-ed on exit, which removes the kernels and brings back any kernel they
overrode; logging (``estimator/fake.py``'s ``quiet_fake_log``) is restored the same way.
The one registration kept for the process: ``rng_hop_rules(mode_class)`` gives each of memfit's own
dispatch modes a rule for torch's two RNG higher-order operators, which a compiled step with a
random op inside a checkpointed region calls at run time and which refuse a mode without a rule
(``torch/_prims/rng_prims.py``); it touches no class but memfit's.
``tests/test_torch_state.py`` checks that an estimate leaves all of it as it found it.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["patched", "environ", "quiet_profiler", "rng_hop_rules"]

_MISSING = object()


@contextlib.contextmanager
def patched(owner, name: str, value):
    """``owner.name = value`` while active; the attribute as it was afterwards (deleted again if it
    was not set on ``owner`` itself, so a class attribute found through inheritance stays inherited)."""
    before = vars(owner).get(name, _MISSING)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)


@contextlib.contextmanager
def environ(name: str, value: str):
    """``os.environ[name] = value`` while active, unless the user set ``name``; restored after."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def quiet_profiler():
    """Silence kineto's two lines per profiler start (see the module docstring)."""
    return environ("KINETO_LOG_LEVEL", "6")


def rng_hop_rules(mode_class) -> None:
    """Torch's CPU rules for ``run_and_save_rng_state`` / ``run_with_rng_state`` under
    ``mode_class`` (see the module docstring): read the generator's state (a 5,056-byte tensor),
    and run the op through the mode, as the dispatcher would have."""
    import torch
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    def save(mode, op, *args, **kwargs):
        return torch.get_rng_state(), mode.__torch_dispatch__(op, (), args, kwargs)

    def run_with(mode, rng_state, op, *args, **kwargs):
        current = torch.get_rng_state()
        torch.set_rng_state(rng_state)
        try:
            return mode.__torch_dispatch__(op, (), args, kwargs)
        finally:
            torch.set_rng_state(current)

    run_and_save_rng_state.py_impl(mode_class)(save)
    run_with_rng_state.py_impl(mode_class)(run_with)
