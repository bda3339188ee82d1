"""Run a user's script or module as ``python SCRIPT.py args`` / ``python -m MODULE args`` would, in this process.

``runpy`` does the running (``__main__``, the script's globals); what is added here is what Python itself
sets around it: ``sys.argv`` as the script sees it, the script's own folder (or, for ``-m``, the current
folder) first on ``sys.path``, both restored afterwards; the current folder is left as it is. A
``SystemExit`` is the script's exit status, as the interpreter would make it.

Left out: ``python -c``, a script read from stdin, and ``__main__.__spec__`` for a plain file (as Python).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

from memfit.errors import MemfitError

__all__ = ["Target", "target", "run", "traceback_text"]


class Target:
    """What to run: ``argv[0]`` is the script's path (or, with ``module``, the module's name)."""

    def __init__(self, argv: list[str], module: bool = False):
        self.argv = list(argv)
        self.module = module

    @property
    def name(self) -> str:
        return self.argv[0]

    def __repr__(self) -> str:
        return ("-m " if self.module else "") + " ".join(self.argv)


def _findable(name: str) -> bool:
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def target(path: str, argv=(), *, module: bool = False) -> Target:
    """A checked ``Target``: the script exists (or the module can be found), else one line naming the fix."""
    path = os.fspath(path) if not module else str(path)
    if module:
        if not _findable(path):
            raise MemfitError(f"no module {path!r}: is it installed, or run from its project's folder?")
    elif not os.path.isfile(path):
        hint = " (a folder: name the script in it)" if os.path.isdir(path) else ""
        raise MemfitError(f"no script {path!r}{hint}: give the path of a Python file (or -m package.module)")
    return Target([path, *map(str, argv)], module)


def run(what: Target) -> int:
    """Run ``what`` to its end (or until it raises); its exit status. Its exceptions propagate."""
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    sys.argv = list(what.argv)
    try:
        if what.module:
            sys.path.insert(0, os.getcwd())
            runpy.run_module(what.name, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(what.name)))
            runpy.run_path(what.name, run_name="__main__")
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def traceback_text(err: BaseException) -> str:
    """``err``'s traceback as Python prints it for the script: from its own frames (memfit's and runpy's left out)."""
    import traceback

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # memfit's own package
    tb = err.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename.startswith(here)
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb or err.__traceback__))
