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
``tests/test_torch_state.py`` checks that an estimate leaves all of it as it found it.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["patched", "environ", "quiet_profiler"]

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
