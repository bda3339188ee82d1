"""Byte sizes in and out: ``24GiB``, ``24GB``, ``80G``, ``512MiB``, plain integers.

Sizes are ints inside memfit; this module is the only place that reads or writes them as text.
"""

from __future__ import annotations

import math
import re

from memfit.errors import MemfitError, shown

__all__ = ["parse_size", "format_size", "MAX_SIZE"]

MAX_SIZE = 1 << 60  # 1 EiB: past any machine's memory; byte counts stay well inside 64 bits

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text``. ``GiB``/``G`` are powers of 1024, ``GB`` powers of 1000.

    ``G`` alone means GiB because that is what ``nvidia-smi`` and PyTorch print.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise MemfitError(f"cannot read size {shown(text)}: write it like 24GiB, 24GB, 80G or 512MiB")
        number = float(match.group(1)) * _UNITS[unit]  # inf for hundreds of digits, never an error
        value = int(number) if math.isfinite(number) and number <= MAX_SIZE else MAX_SIZE + 1
    if value <= 0:
        raise MemfitError(f"size {shown(text)} must be positive: write it like 24GiB")
    if value > MAX_SIZE:
        raise MemfitError(f"size {shown(text)} is over 1 EiB, more memory than any machine has: write it like 24GiB")
    return value


def format_size(nbytes: int | float) -> str:
    """``25769803776`` -> ``24.00 GiB``; binary units, two decimals past KiB."""
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
