"""The planner's search space: every candidate recipe ``plan`` predicts.

The axes are the registered techniques' own (``Technique.search``: precision x LoRA x
checkpointing x activation offload x chunked loss x optimizer x micro-batch / accumulation x
optimizer-in-backward for the built-in ones), nested in apply's order; a combination ``Recipe``
rejects, or a technique marks as not worth searching, is skipped. Techniques that change the math
are searched only when ``allow`` names them.

A custom optimizer (a callable ``params -> Optimizer``) is planned as the user built it: the
fields that name or rebuild an optimizer (``BY_NAME``: 8-bit states, ``optimizer_impl``,
``offload_optimizer``) stay at their defaults, since the estimate that checks a plan refuses
``optimizer_impl`` with a callable and would run the callable under any other name.
"""

from __future__ import annotations

import itertools

from memfit.errors import MemfitError, shown
from memfit.techniques.accumulation import divisors
from memfit.techniques.recipe import Recipe
from memfit.techniques.registry import techniques
from memfit.techniques.spec import SearchContext

__all__ = ["ALLOWABLE", "BY_NAME", "allowable", "allowed_names", "search_space", "search_context", "divisors",
           "by_name", "custom_optimizer", "optimizer_name"]

#: the Recipe fields that take effect only on an optimizer memfit builds by name: with a custom
#: optimizer ``make_optimizer`` runs the callable whatever ``optimizer`` says and refuses an
#: ``optimizer_impl`` other than auto, and ``offload_optimizer`` refuses a callable
BY_NAME = ("optimizer", "optimizer_impl", "offload_optimizer")


def custom_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is the user's own ``params -> Optimizer`` rather than a name."""
    return callable(optimizer)


def optimizer_name(optimizer) -> str:
    """The name a plan's recipes carry for ``optimizer``: a custom one's is the placeholder
    ``recipe_from`` gives an ``estimate`` with a callable (``Recipe().optimizer``)."""
    return Recipe().optimizer if custom_optimizer(optimizer) else optimizer


def by_name(recipe: Recipe) -> bool:
    """Whether every ``BY_NAME`` field of ``recipe`` is at its default (what a custom optimizer takes)."""
    default = Recipe()
    return all(getattr(recipe, name, None) == getattr(default, name, None) for name in BY_NAME)


def allowable() -> tuple[str, ...]:
    """What ``allow`` may name: values of techniques that change the math, never chosen otherwise."""
    return tuple(name for t in techniques() for name in t.allow)


ALLOWABLE = allowable()  # the built-in techniques' names


def allowed_names(allow) -> set[str]:
    if allow is None:
        return set()
    if isinstance(allow, str):
        allow = [a for a in allow.split(",") if a.strip()]
    try:
        names = {str(a).strip().lower() for a in allow}
    except TypeError:
        raise MemfitError(f"allow takes names, e.g. allow='lora,adamw8bit', got {shown(allow)}") from None
    known = allowable()
    unknown = sorted(names - set(known))
    if unknown:
        raise MemfitError(f"cannot allow {', '.join(shown(u, 30) for u in unknown)}: allow takes {', '.join(known)}")
    return names


def search_context(engine, allowed: set[str], optimizer) -> SearchContext:
    """What the techniques' ``search`` see of the planner's question (a custom optimizer as its
    placeholder name; ``search_space`` keeps its candidates to ``by_name`` ones)."""
    return SearchContext(gpu=engine.target, allowed=frozenset(allowed), optimizer=optimizer_name(optimizer),
                         global_batch_size=engine.global_batch_size, depth=engine.depth or 0,
                         has_blocks=engine.has_blocks, causal_lm=engine.causal_lm)


def search_space(engine, allowed: set[str], optimizer, fixed: dict | None = None) -> list[Recipe]:
    """Every candidate recipe; combinations ``Recipe`` rejects are skipped, and with a custom
    optimizer (a callable) those that would rebuild it by name (``by_name``). ``fixed``: Recipe
    fields the user set (``check_fixed``), the same in every candidate: a technique's axis keeps the
    values that agree with them (its only value where none does: a value the user chose is theirs,
    allowed or searched or not), and a field no search varies is set on every candidate."""
    ctx = search_context(engine, allowed, optimizer)
    searched = techniques()
    fixed = dict(fixed or {})
    axes = []
    for t in searched:
        values = list(t.search(ctx)) if t.search is not None else [{}]
        mine = {f.name: fixed.pop(f.name) for f in t.fields if f.name in fixed}
        if mine:
            agree = [{**v, **mine} for v in values if all(v.get(k, mine[k]) == mine[k] for k in mine)]
            values = list({tuple(sorted(v.items(), key=str)): v for v in agree}.values()) or [mine]
        axes.append(values)
    keep = [t.searchable for t in searched if t.searchable is not None]
    if custom_optimizer(optimizer):
        keep.append(by_name)
    out = []
    for choice in itertools.product(*axes):
        values = dict(fixed)  # the fields no technique's search varies
        for part in choice:
            values.update(part)
        try:
            recipe = Recipe(**values)
        except MemfitError:
            continue
        if all(ok(recipe) for ok in keep):
            out.append(recipe)
    return out


def check_fixed(fixed) -> dict:
    """``plan(fixed=...)``: a mapping of Recipe field names to values (or a Recipe: its fields that
    differ from the defaults), each checked as ``Recipe`` checks it."""
    if fixed is None:
        return {}
    if isinstance(fixed, Recipe):
        default = Recipe()
        return {k: v for k, v in fixed.to_dict().items() if getattr(default, k) != v}
    if not isinstance(fixed, dict):
        raise MemfitError(f"fixed takes a dict of Recipe fields (e.g. {{'precision': 'bf16-mixed'}}), got "
                          f"{type(fixed).__name__} {shown(fixed, 40)}")
    unknown = sorted(str(k) for k in fixed if k not in Recipe.fields())
    if unknown:
        raise MemfitError(f"fixed names no Recipe field {', '.join(shown(u, 30) for u in unknown)}: the fields are "
                          f"{', '.join(Recipe.fields())}")
    Recipe(**fixed)  # a bad value, or fixed values that conflict, is Recipe's one line
    return dict(fixed)
