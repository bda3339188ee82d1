"""Optimizers that step other optimizers without torch's step hooks of their own: one step to a profile.

torch's global step hooks (``register_optimizer_step_pre_hook`` / ``_post_hook``) fire from the wrapper
``Optimizer.__init__`` puts around ``step``. torchao's ``CPUOffloadOptimizer`` never runs that ``__init__``
(``torchao/optim/cpu_offload.py``) and steps one inner torch optimizer per parameter, so a profile saw each
parameter's step as a whole optimizer step (a script's ``--steps 2`` stopped after two parameters' updates, before the
rest of the state existed). While a profile runs, that class's ``step`` calls the profile's begin and end around it,
and the inner steps nest inside it (the profile counts only the outermost). A class imported later (by the user's
script) is wrapped as it is imported: a finder on ``sys.meta_path`` for its module alone. Written by hand: torch offers
no hook for an optimizer that bypasses its ``__init__``.

Left out: other optimizers of that kind (none known); an exception inside the step ends it without the profile's end,
as torch's own hooks do.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys

__all__ = ["hooked", "COMPOSITES"]

#: module -> the class in it whose ``step`` steps other optimizers unhooked
COMPOSITES = {"torchao.optim.cpu_offload": "CPUOffloadOptimizer"}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules of ``COMPOSITES`` as the other finders do, and wraps their class once executed."""

    def __init__(self, wrap):
        self.wrap = wrap

    def find_spec(self, fullname, path, target=None):
        if fullname not in COMPOSITES:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return spec
        loader, wrap = spec.loader, self.wrap

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                wrap(module)

        spec.loader = Loader()
        return spec


@contextlib.contextmanager
def hooked(begins, ends):
    """While inside, each ``COMPOSITES`` class's ``step`` calls ``begins(optimizer, args, kwargs)`` before and
    ``ends(optimizer, args, kwargs)`` after, as torch's global step hooks are called."""
    wrapped = []

    def wrap(module) -> None:
        cls = getattr(module, COMPOSITES.get(module.__name__, ""), None)
        if cls is None or getattr(cls.step, "_memfit_hooked", False):
            return
        original = cls.step

        @functools.wraps(original)
        def step(self, *args, **kwargs):
            begins(self, args, kwargs)
            out = original(self, *args, **kwargs)
            ends(self, args, kwargs)
            return out

        step._memfit_hooked = True
        cls.step = step
        wrapped.append((cls, original))

    for name in COMPOSITES:
        if name in sys.modules:
            wrap(sys.modules[name])
    finder = _Finder(wrap)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for cls, original in wrapped:
            cls.step = original
