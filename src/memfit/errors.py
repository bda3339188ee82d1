"""The one exception a user sees.

A ``MemfitError`` carries a single line that says what is wrong and how to fix it. The CLI prints
it and exits with status 2; library callers can catch it. Anything else escaping is a bug.

The line stays one short line whatever went into it: line breaks and runs of whitespace become
one space, and a message longer than ``MAX_MESSAGE`` characters is cut in the middle (a value the
user typed can be megabytes; the fix is named at the end). ``shown`` quotes such a value briefly.
"""

from __future__ import annotations

import os
import sys
import sysconfig

__all__ = ["MemfitError", "MAX_MESSAGE", "shown", "library_roots", "user_frame"]

MAX_MESSAGE = 400  # characters: room for the longest fix we name (the GPU list) and a quoted value


class MemfitError(ValueError):
    """Bad input or an unsupported case, explained in one line that names the fix."""

    def __init__(self, message="", *args):
        super().__init__(_one_line(str(message)), *args)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    if len(text) <= MAX_MESSAGE:
        return text
    half = (MAX_MESSAGE - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def shown(value, limit: int = 60) -> str:
    """``repr(value)``, cut to about ``limit`` characters, for quoting user input in a message."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 — a user object whose __repr__ fails is still an object
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def library_roots() -> tuple[str, ...]:
    """Folders whose files are not the user's code: torch, memfit, the standard library, installed packages."""
    import torch

    roots = {os.path.dirname(torch.__file__), os.path.dirname(__file__)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(path)
    roots.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots))


def user_frame(err: BaseException) -> str | None:
    """``"file.py:LINE"``: where in the user's own code (a factory, a batch or loss function, a model class of
    theirs) ``err`` was raised, its innermost such frame; None when the traceback holds none."""
    library, found = library_roots(), None
    tb = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith("<") and not os.path.realpath(name).startswith(library):
            found = (name, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    try:
        rel = os.path.relpath(found[0])
    except ValueError:
        rel = found[0]
    return f"{found[0] if rel.startswith('..') else rel}:{found[1]}"
