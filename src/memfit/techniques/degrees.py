"""What the mesh techniques (tensor, pipeline, context and expert parallel) check alike: a degree is a whole number
of ranks, and a pair of techniques memfit has not graded against real runs is refused in one line naming both.

Each technique keeps its own list of unchecked pairs (``_INCOMPATIBLE`` in its module); these two helpers say the
error the same way for all four."""

from __future__ import annotations

from memfit.errors import MemfitError, shown

__all__ = ["check_degree", "unchecked_pair"]


def check_degree(name: str, value, unit: str, off: str) -> None:
    """``value`` is a degree from 1 to 1024 (``unit``: what it counts; ``off``: what 1 means), else one line."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
        raise MemfitError(f"{name} must be {unit} from 1 to 1024 (1: {off}), got {shown(value)}")


def unchecked_pair(recipe, name: str, pairs, why: str = "memfit has not checked that pair against real runs yet"
                   ) -> str | None:
    """The first of ``pairs`` ((field, recipe -> bool)) ``recipe`` sets beside ``name``'s degree, as one line."""
    for field, clashes in pairs:
        if clashes(recipe):
            return f"{name}={getattr(recipe, name)} and {field}={getattr(recipe, field)} conflict: {why}; drop one"
    return None
