"""``torch.compile`` in a user's script, estimated as memfit estimates compiled steps (``techniques/compile.py``).

The script's ``torch.compile(model)`` (or of a function, or ``model.compile()``) gets Inductor's own plan —
dynamo, AOTAutograd's partitioner, Inductor's fusion and buffer reuse — with the generated wrapper run on
no-op kernels, so the ledger records the compiled step's allocations in Inductor's order. While the script runs,
Python's cyclic collector is paused (compiling makes garbage; ``compile_scope``) and dynamo is reset after.

Left out: ``mode=`` and ``options=`` (max-autotune, CUDA graphs: each is a note, the plan is Inductor's
default), backends other than Inductor (their plans are their own: run eager, with a note), and under CUDA
semantics the plan is Inductor's CPU backend's (its CUDA backend needs a GPU to lower for).
"""

from __future__ import annotations

import contextlib
import gc

import torch

from memfit.scoped import patched

__all__ = ["Compiling"]


class Compiling:
    """While active, ``torch.compile`` plans on fake tensors; ``notes`` says what was compiled and what was not.

    A compiled call runs with memfit's function modes off (``script/values.py``, ``script/device.py``): dynamo
    would trace them into the graph (graph breaks a real run has not); with ``shim`` (a card), ``tensor.device``
    tells the truth to dynamo (a ``cuda`` device in the graph would make Inductor lower for CUDA) and what the call
    makes is the card's when its inputs are (``shim.compiled_call``)."""

    def __init__(self, shim=None):
        self.shim = shim
        self.notes: list[str] = []
        self.count = 0
        self._scope = None

    def _plain(self, call):
        """``call`` (a compiled forward or function) run as described in the class docstring."""
        import functools

        shim = self.shim

        @functools.wraps(call)
        def run(*args, **kwargs):
            with torch._C.DisableTorchFunction(), (shim.compiled_call(args, kwargs) if shim is not None
                                                   else contextlib.nullcontext()):
                return call(*args, **kwargs)

        return run

    def compile(self, model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                disable=False, **kwargs):
        from memfit.techniques.compile import planned_compile

        if model is None:  # used as a decorator with arguments
            return lambda target: self.compile(target, fullgraph=fullgraph, dynamic=dynamic, backend=backend,
                                               mode=mode, options=options, disable=disable, **kwargs)
        if disable:
            return model
        if backend not in ("inductor", None):
            self.notes.append(f"torch.compile(backend={backend!r}) ran eager: only Inductor's plan is estimated")
            return model
        if mode not in (None, "default") or options:
            self.notes.append(f"torch.compile(mode={mode!r}) estimated with Inductor's default plan")
        self.count += 1
        planned = planned_compile(model, dynamic=dynamic, fullgraph=fullgraph)
        if isinstance(planned, torch.nn.Module):
            planned.forward = self._plain(planned.forward)
            return planned
        return self._plain(planned)

    def _module_compile(self, module, *args, **kwargs):
        module._compiled_call_impl = self.compile(module._call_impl, *args, **kwargs)


    def __enter__(self) -> "Compiling":
        import memfit.techniques.compile  # noqa: F401 — imported before torch.compile is replaced: it keeps torch's

        with contextlib.ExitStack() as scope:
            scope.enter_context(patched(torch, "compile", self.compile))
            scope.enter_context(patched(torch.nn.Module, "compile", self._module_compile))
            enabled = gc.isenabled()
            gc.disable()
            scope.callback(lambda: gc.enable() if enabled else None)
            scope.callback(lambda: torch._dynamo.reset() if self.count else None)
            self._scope = scope.pop_all()
        return self

    def __exit__(self, *exc):
        self._scope.close()
        return False
