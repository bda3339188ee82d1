"""How a memory technique declares itself: ``Field``, ``Technique``, and what they are handed.

A technique is one module of ``memfit.techniques`` that defines ``TECHNIQUE = Technique(...)``.
Everything else reads the declaration: ``Recipe`` its fields (validation, defaults, files), the CLI
one flag per field, ``apply`` its place in the order and what it does to the model, loss,
optimizer or step (``Build``), the planner the values it searches (``SearchContext``) and which
traces those values change. Adding a technique is adding its module; no other file lists it.

Written by hand: no library declares training techniques this way (torchtune's recipes are
config keys read by hand in each recipe; Accelerate's plugins are classes per feature).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["Field", "Technique", "Build", "SearchContext", "KINDS", "TRACES"]

#: how a field's value is typed: text (closed or open set), true/false, an integer, a positive
#: integer, a positive integer that may be None ("not set"), or a real number (range checked by
#: the field's own ``check``)
KINDS = ("str", "bool", "int", "count", "optional-count", "float")
#: which of the planner's traces a technique's values change (``planner/compose.py``):
#: graph       the forward/backward trace (one per combination of these fields' values)
#: optimizer   the optimizer trace (state and step)
#: both        both traces (precision, LoRA)
#: composed    neither: the planner composes it from the others (accumulation, stepping in backward)
#: none        the planner does not search it
TRACES = ("graph", "optimizer", "both", "composed", "none")


@dataclass(frozen=True)
class Field:
    """One ``Recipe`` field, its CLI flag and how its values are checked."""

    name: str  # the Recipe field; the CLI flag is ``--`` + name with ``-`` for ``_``
    default: object  # the value when nobody sets it (the plain step)
    help: str  # the flag's help: one line, what it does to memory and what it costs
    slot: int  # position among the Recipe's fields (files, ``describe``, ``to_dict``)
    kind: str = "str"  # one of KINDS
    choices: tuple = ()  # a closed set of values; empty: any value ``check`` accepts; kind "bool": the
    # strings it takes besides true and false (``compile``: "layers")
    check: Callable[[object], None] | None = None  # raises MemfitError naming the fix for a bad value
    flag_choices: bool = True  # offer ``choices`` to argparse (False: Recipe's message lists them)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _nothing(_recipe) -> tuple:
    return ()


@dataclass(frozen=True)
class Technique:
    """A memory technique, declared once (see the module docstring).

    ``apply(build)`` is called in ``order`` (lower first) on a ``Build`` it may change; it reads its
    own fields from ``build.recipe``. ``search(ctx)`` gives the planner's candidate values as
    dicts of field values (None: only the default). ``searchable(recipe)`` drops a combination the
    planner should not try although ``Recipe`` accepts it. ``conflicts(recipe)`` and
    ``approximations(recipe)`` yield one-line messages and ``field=value`` entries.
    """

    name: str  # what ``allow``, messages and the registry call it
    fields: tuple[Field, ...]  # the Recipe fields it owns
    order: int  # place in apply's order: model transforms < loss < optimizer < step
    apply: Callable[["Build"], None] | None = None
    search: Callable[["SearchContext"], Iterable[dict]] | None = None
    searchable: Callable[[object], bool] | None = None
    conflicts: Callable[[object], Iterable[str]] = _nothing
    approximations: Callable[[object], Iterable[str]] = _nothing  # non-empty: changes the math
    allow: tuple[str, ...] = ()  # names ``plan(allow=...)`` takes to search its math-changing values
    trace: str = "graph"  # one of TRACES
    # values -> values, before they are checked: a value in another vocabulary (transformers'
    # optim names) rewritten as this technique's fields
    normalize: Callable[[dict], dict] | None = None


@dataclass
class Build:
    """What ``apply``'s techniques transform, in order; ``apply`` then makes the step from it."""

    recipe: object  # the Recipe being applied (read-only)
    model: object  # the nn.Module; a technique may replace it (LoRA wraps it)
    device_type: str  # "cpu" or "cuda": where the parameters are
    watch: object  # the ledger (or a stand-in) that labels tensors: ``mark(tensor, category)``
    loss_fn: Callable | None = None  # loss_fn(model, batch) -> scalar; None: ``model(**batch).loss``
    user_loss: bool = False  # whether loss_fn came from the caller (a technique that is a loss conflicts)
    optimizer_spec: object = "adamw"  # the optimizer's name, or the caller's params -> Optimizer
    make_optimizer: Callable | None = None  # params -> Optimizer, built after every technique ran
    forward_contexts: list = field(default_factory=list)  # () -> context manager, around each forward
    pack: list = field(default_factory=list)  # (pack, unpack) pairs for tensors saved for backward
    scaler: object = None  # a GradScaler the step scales the loss with and steps through
    split: Callable | None = None  # batch -> micro-batches (None: the batch is one micro-batch)
    set_to_none: bool = True  # zero_grad frees the gradients (True) or zeroes them in place
    wrap_step: Callable | None = None  # optimizer -> the callable the step runs instead of optimizer.step
    before_micro: list = field(default_factory=list)  # (model, last: bool) -> None, before each micro-batch
    step_contexts: list = field(default_factory=list)  # () -> context manager, around each whole step
    pipeline: Callable | None = None  # (micro-batches, watch, step) -> loss: a pipeline stage's schedule runs
    #                                   them all (forward, loss and backward), in place of the step's own loop
    micro_contexts: list = field(default_factory=list)  # () -> context manager, around each micro-batch's
    #                                                     forward and backward (loss parallel)
    batch_contexts: list = field(default_factory=list)  # (micro-batch) -> context manager, around its forward and
    #                                                     backward (context parallel shards its sequence)
    engine: object = None  # an engine that owns forward, backward and the step (DeepSpeed's, set when the optimizer
    #                        is made): the step calls it as the model and ``engine.backward(loss)``


@dataclass(frozen=True)
class SearchContext:
    """What a technique's ``search`` may look at: the planner's question, not its answers."""

    gpu: object  # the catalog GPU planned for (``hardware.gpus.GPU``), None on the CPU
    allowed: frozenset  # names the user allowed (see ``Technique.allow``)
    optimizer: str  # the optimizer the user trains with
    global_batch_size: int  # examples per optimizer step
    depth: int  # repeated blocks of the model (0: none found)
    has_blocks: bool  # whether checkpointing finds blocks to wrap
    causal_lm: bool  # a causal LM with its own loss (chunked loss applies)
