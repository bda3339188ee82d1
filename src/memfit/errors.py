"""The one exception a user sees.

A ``MemfitError`` carries a single line that says what is wrong and how to fix it. The CLI prints
it and exits with status 2; library callers can catch it. Anything else escaping is a bug.
"""

from __future__ import annotations

__all__ = ["MemfitError"]


class MemfitError(ValueError):
    """Bad input or an unsupported case, explained in one line that names the fix."""
