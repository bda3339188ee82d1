"""What the verbs share: argument types, the flags several verbs take (each defined once here), the
Recipe flags, and the helpers around a run (progress bar, ``--out`` check, ``package.module:function``).

The Recipe flags come from a static table of the techniques' fields (``_recipe_flags``, kept equal to
the registry by a test), so building a verb's parser imports no torch and its ``--help`` is quick.

Every flag sits in one of ``SECTIONS`` (argparse argument groups), the same for every verb and in the same
order, so a verb's ``--help`` reads model, batch, techniques, optimizer, LoRA, GPUs, card, output rather than
one list of seventy flags; tests/test_help.py holds every flag to a section and a one-line help.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from memfit.cli import _recipe_flags, _spellings
from memfit.errors import MemfitError, shown
from memfit.units import parse_size

__all__ = ["SECTIONS", "section", "size", "positive", "tokens", "integer", "number", "add_model", "model_of", "add_gpu", "add_budget", "add_device", "add_seq_len", "add_recipe",
           "add_batch", "add_world", "add_loss", "add_out", "add_json", "recipe_fields", "allowable", "recipe_flags",
           "recipe_from_args", "import_spec", "progress", "check_out", "check_gpu_device"]

SEQ_LEN_HELP = "tokens per example (default: the model's, at most 2048)"

#: the sections of a verb's --help, in the order it prints them: key -> title. A verb shows only those it puts
#: a flag in (argparse prints no empty group); the Recipe's flags take theirs from ``_recipe_flags.CLI``.
SECTIONS = {
    "model": "model",
    "script": "your script",
    "error": "the out-of-memory error",
    "data": "data",
    "recipe": "recipe and config files",
    "batch": "batch and sequence",
    "run": "training run",
    "precision": "precision and memory techniques",
    "optimizer": "optimizer",
    "lora": "LoRA and quantized weights",
    "parallel": "many GPUs and meshes",
    "launch": "many processes (torchrun; the recipe's --parallel fsdp or ddp)",
    "card": "card, budget and device",
    "serving": "serving",
    "generation": "inference and generation",
    "planning": "planning",
    "tracing": "tracing",
    "checkpoints": "checkpoints and logs",
    "filters": "filters",
    "server": "server",
    "output": "output",
}


def section(parser, key: str):
    """``parser``'s argument group for ``SECTIONS[key]``; the first call adds them all, in SECTIONS' order."""
    groups = getattr(parser, "_memfit_sections", None)
    if groups is None:
        groups = {name: parser.add_argument_group(title) for name, title in SECTIONS.items()}
        parser._memfit_sections = groups
    return groups[key]


def size(text: str) -> int:
    try:
        return parse_size(text)
    except MemfitError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # not a number, or past int()'s 4300 digits
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a positive integer")
    return value


def tokens(text: str) -> int:
    """``positive``, but ``4k`` is refused with its reason (``_spellings.thousands``)."""
    _spellings.thousands(text)
    return positive(text)


def integer(text: str) -> int:
    """``int``, but a value that is not one is quoted briefly (it can be thousands of characters)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None


# The flags estimate, fit and plan share. Type, default and name are fixed here; the help says what
# the flag means for the verb, so the verbs whose meaning differs pass their own.

def add_model(parser, optional: bool = False) -> None:
    """The model argument; ``optional``: it may be left to a ``--from`` file that names one."""
    group = section(parser, "model")
    group.add_argument("model", nargs="?" if optional else None, default=None,
                       help="a Hub id (config only), a config.json or its folder, a catalog name, module:function"
                       + (" (or --from's)" if optional else ""))
    group.add_argument("--revision", default=None, help="with a Hub id: the branch, tag or commit to read (default main)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="run the repository's own model code (auto_map in config.json), as transformers asks")


def model_of(args):
    """The model argument as the API takes it: the name itself, or a resolved source when --revision or
    --trust-remote-code say how to read it."""
    if args.revision is None and not args.trust_remote_code:
        return args.model
    from memfit.models.source import resolve

    return resolve(args.model, revision=args.revision, trust_remote_code=args.trust_remote_code)


def add_gpu(parser, help: str, default: str | None = None) -> None:
    group = section(parser, "card")
    group.add_argument("--gpu", default=default, metavar="CARD", help=help, action=_Gpu)
    group.add_argument("--unified-memory", dest="gpu", action=_UnifiedMemory, metavar="SIZE",
                       help="a Mac of this much RAM, e.g. 48GiB (MPS semantics; a listed one: --gpu m3-max-36gb)")


class _Gpu(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "_unified_memory", False):
            raise argparse.ArgumentError(self, "--unified-memory and --gpu both name the device: drop one")
        setattr(namespace, self.dest, values)
        namespace._gpu_given = True


class _UnifiedMemory(argparse.Action):
    """``--unified-memory SIZE``: the card ``mac-<GiB>gb`` (``hardware/macs.py``), refused beside ``--gpu``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "_gpu_given", False):
            raise argparse.ArgumentError(self, "--unified-memory and --gpu both name the device: drop one")
        try:
            gib = size(values) / 2**30
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentError(self, str(err)) from None
        setattr(namespace, self.dest, f"mac-{gib:g}gb")
        namespace._unified_memory = True


def add_budget(parser, help: str = "bytes available, e.g. 24GiB, 24GB, 80G (default: the --gpu's memory)") -> None:
    section(parser, "card").add_argument("--budget", type=size, default=None, metavar="SIZE", help=help)


def add_device(parser, default: str | None, help: str, choices=("cpu", "cuda")) -> None:
    section(parser, "card").add_argument("--device", choices=choices, default=default, help=help)


def add_seq_len(parser) -> None:
    section(parser, "batch").add_argument("--seq-len", type=tokens, default=None, metavar="N",
                                          help=SEQ_LEN_HELP)


def add_recipe(parser) -> None:
    section(parser, "recipe").add_argument("--recipe", default=None, metavar="FILE",
                                           help="a recipe .yaml/.json (memfit plan --out writes one); flags override it")


def add_from(parser) -> None:
    section(parser, "recipe").add_argument(
        "--from", dest="from_config", default=None, metavar="PATH",
        help="your trainer's config (TrainingArguments, SFTConfig, accelerate, LightningCLI); flags override it")


def trainer_config(args):
    """The ``--from`` file read (None without one); ``--recipe`` beside it is one error."""
    if getattr(args, "from_config", None) is None:
        return None
    if args.recipe is not None:
        raise MemfitError("--from and --recipe conflict: both give the recipe; keep one (flags override either)")
    from memfit.trainers.read import read_trainer_config

    return read_trainer_config(args.from_config)


def add_world(parser, help: str = "GPUs per node (default 1): the report is the worst rank's; --batch-size spans "
                                  "them all") -> None:
    """The cluster of a data-parallel run (``--parallel ddp|fsdp``): GPUs per node and nodes."""
    group = section(parser, "parallel")
    group.add_argument("--gpus", type=positive, default=None, metavar="N", help=help)
    group.add_argument("--nodes", type=positive, default=None, metavar="N",
                       help="nodes of --gpus GPUs each (default 1): FSDP shards within a node, replicates between")


def add_batch(parser, help: str) -> None:
    section(parser, "batch").add_argument("--batch", default=None, metavar="FUNCTION", help=help)


def add_loss(parser) -> None:
    section(parser, "model").add_argument("--loss", default=None, metavar="FUNCTION",
                                          help="package.module:function(model, batch) -> scalar loss "
                                               "(default: the model's own)")


def add_out(parser, help: str) -> None:
    section(parser, "output").add_argument("--out", default=None, metavar="FILE", help=help)


def add_json(parser, help: str) -> None:
    section(parser, "output").add_argument("--json", action="store_true", help=help)


def recipe_fields() -> tuple:
    """The Recipe's fields as ``_recipe_flags.FLAGS`` rows: that static table, so a verb's --help needs
    no torch; the live registry where this process has loaded it (a plug-in's field gets its flag)."""
    if "memfit.techniques.registry" in sys.modules:
        from memfit.techniques.registry import fields

        return tuple(_recipe_flags.row(f) for f in fields())
    return _recipe_flags.FLAGS


def allowable() -> tuple:
    """What ``plan --allow`` takes (as ``recipe_fields``: the static table unless the registry is loaded)."""
    if "memfit.techniques.registry" in sys.modules:
        from memfit.planner.space import allowable

        return allowable()
    return _recipe_flags.ALLOWABLE


# Recipe fields whose flag reads the spellings people type (``_spellings``); a field with choices reads them in
# any case, and a flag marked bare may be given alone: ``--lora`` is lora (rank 16), ``--checkpointing`` blocks
_SPELLING = {"lora": _spellings.lora, "checkpointing": _spellings.checkpointing, "precision": _spellings.precision,
             "lora_dtype": _spellings.dtypes, "mixed_precision": _spellings.dtypes}
_BARE = {"lora": "lora", "checkpointing": "blocks"}
_METAVAR = {"int": "N", "count": "N", "optional-count": "N", "float": "X"}


def recipe_flags(parser) -> None:
    """One flag per Recipe field, from the techniques' declarations (``techniques/spec.py``), in its section of
    --help (``_recipe_flags.CLI``); None means "not given", so a --recipe file's value stands. A true/false
    field is settable both ways (``--set-to-none`` / ``--no-set-to-none``)."""
    types = {"int": integer, "count": positive, "optional-count": positive, "float": number}
    for name, kind, choices, help in recipe_fields():
        flag = "--" + name.replace("_", "-")
        key, help = _recipe_flags.CLI.get(name, ("precision", help))
        group = section(parser, key)
        if kind == "bool" and choices:  # --flag alone: true; --flag VALUE: true, false or a choice; --no-flag: false
            group.add_argument(flag, nargs="?", const=True, type=_spellings.switch(choices), default=None,
                               metavar="{" + ",".join(("true", "false", *choices)) + "}", help=help)
            group.add_argument("--no-" + flag[2:], dest=name, action="store_const", const=False,
                               help=f"{flag} false (overrides a --recipe file)")
        elif kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            read = _SPELLING.get(name) or (_spellings.choice(choices) if choices else types.get(kind))
            metavar = None if choices else _METAVAR.get(kind, "VALUE")
            group.add_argument(flag, type=read, choices=choices or None, default=None, metavar=metavar, help=help,
                               **({"nargs": "?", "const": _BARE[name]} if name in _BARE else {}))


def recipe_from_args(args, base=None):
    """The recipe of ``--recipe`` (or ``base``: a ``--from`` file's) with the flags' fields over it."""
    from memfit.techniques.recipe import Recipe

    if base is None:
        base = Recipe.load(args.recipe) if args.recipe else Recipe()
    changes = {name: getattr(args, name) for name in Recipe.fields() if getattr(args, name, None) is not None}
    return base.replace(**changes) if changes else base


def import_spec(spec: str | None):
    """``package.module:function`` to the object (None stays None)."""
    from memfit.models.check import import_object

    return None if spec is None else import_object(spec)


@contextlib.contextmanager
def progress(description: str):
    """A bar on stderr (``--json`` output stays clean): a spinner and the elapsed time, and the count
    done of the total once the work reports one through the ``update(done, total)`` this yields."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    # not drawn where stderr is no terminal (a log, a pipe, a test): it would leave a blank line there
    with Progress(SpinnerColumn(), TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as shown:
        task = shown.add_task(description, total=None)
        yield lambda done, total: shown.update(task, completed=done, total=total)


def check_gpu_device(args) -> None:
    if args.device == "cpu" and args.gpu is not None:
        raise MemfitError("--gpu and --device cpu conflict: drop one")


def check_file(flag: str, path: str | None) -> None:
    """Refuse an output file that could not be written (a directory, a missing folder), before the work."""
    if path is None:
        return
    if os.path.isdir(path):
        raise MemfitError(f"{flag} {path} is a directory: name a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise MemfitError(f"{flag} {path}: the directory {folder} does not exist; create it first")


def check_out(path: str) -> None:
    """Refuse an --out the recipe could not be written to, before the plan runs (minutes)."""
    folder = os.path.dirname(os.path.abspath(path)) if path else ""
    if not path.endswith((".yaml", ".yml", ".json")):
        raise MemfitError(f"--out {path!r} must end in .yaml, .yml or .json: name the recipe file")
    if os.path.isdir(path):
        raise MemfitError(f"--out {path} is a directory: name a .yaml or .json file in it")
    if not os.path.isdir(folder):
        raise MemfitError(f"--out {path}: the directory {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise MemfitError(f"--out {path}: cannot write to {folder}; choose another directory")
