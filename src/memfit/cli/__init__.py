"""The ``memfit`` command: thin argument parsing over the public API.

Every command prints a human table by default and JSON with ``--json``. Bad input is one line on
stderr and exit status 2, never a traceback.

One module per verb (``estimate``, ``fit``, ``plan``, ``catalog`` for ``models`` and ``gpus``), each
with ``build(parser)`` (its flags) and a ``run(args)``; what they share is in ``_args``, the third-party
noise the command filters in ``_noise``. A verb's module and its flags load only when that verb is on
the command line, and its heavy imports (torch, transformers, rich) only when it runs: the Recipe
flags come from a static table (``_recipe_flags``), so ``memfit --help`` and ``memfit VERB --help``
take about 0.1 s (tests/test_cli_conventions.py holds them under a second or two and free of torch).

Tables fit 80 columns and take their colours from rich, which honours ``NO_COLOR``; nothing here
writes escape codes itself. Shell completion is left out: argparse has none of its own.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from memfit.errors import MemfitError

__all__ = ["main", "version"]

# verb: (module in memfit.cli, its build function, its run function, its line in `memfit --help`); the
# help lines live here so that `memfit --help` imports no verb module
_VERBS = {
    "estimate": ("estimate", "build", "run", "memory of one training step, or of your own script.py, on fake "
                 "tensors (no GPU, no memory)"),
    "fit": ("fit", "build", "run", "the largest micro-batch of a recipe that fits a card or a budget; --longest: the longest sequence"),
    "plan": ("plan", "build", "run", "the fastest recipe that fits a budget, and why"),
    "train": ("train", "build", "run", "train inside a budget: OOMs survived, no sample lost, resumable"),
    "profile": ("profile", "build", "run", "watch a real training script's memory: steps, categories, leaks, pictures"),
    "serve-plan": ("serve_plan", "build", "run", "requests x context that fit a card when serving, beside vLLM's blocks"),
    "doctor": ("doctor", "build", "run", "explain an out-of-memory error and rank the fixes by the bytes they save"),
    "ui": ("ui", "build", "run", "a local page (Gradio): estimate, plan, configs and serving plan; pip install 'memfit[ui]'"),
    "models": ("catalog", "build_models", "models", "list the built-in model catalog"),
    "gpus": ("catalog", "build_gpus", "gpus", "list the GPU catalog"),
}


def _verb(name: str, attr: str):
    return getattr(importlib.import_module(f"memfit.cli.{_VERBS[name][0]}"), attr)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), not the whole usage text.

    A verb's parser gets its arguments (``build``) the first time it parses or prints its help:
    only the verb on the command line imports what its flags need.
    """

    def __init__(self, *args, build=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._build = build

    def _built(self) -> None:
        if self._build is not None:
            build, self._build = self._build, None
            build(self)

    def parse_known_args(self, args=None, namespace=None):
        self._built()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._built()
        return super().format_usage()

    def format_help(self) -> str:
        self._built()
        return super().format_help()

    def error(self, message: str):
        from memfit.cli._spellings import FALSE, TRUE

        if message.startswith("unrecognized arguments:") and set(message.lower().split()[2:]) & {*TRUE, *FALSE}:
            message += " (a true/false flag takes no value: --flag for true, --no-flag for false)"
        self.exit(2, f"{self.prog}: error: {MemfitError(message)} (see {self.prog} --help)\n")


def version() -> str:
    """The installed package's version; a source tree on sys.path (not installed) has memfit.__version__."""
    from importlib import metadata

    try:
        return metadata.version("memfit")
    except metadata.PackageNotFoundError:  # memfit is loaded already: memfit.cli is its subpackage
        return getattr(sys.modules.get("memfit"), "__version__", "unknown")


class _Version(argparse.Action):
    """``--version``: as argparse's own, but the version is looked up only when asked for."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="print memfit's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"memfit {version()}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memfit", description="Make PyTorch training fit in the GPU memory you have.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (_, build, _, text) in _VERBS.items():
        sub.add_parser(name, help=text, build=lambda p, name=name, build=build: _verb(name, build)(p))
    return parser


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["estimate"]:
        from memfit.cli import estimate_script

        found = estimate_script.split(words[1:])
        if found is not None:  # a user's script: its words are its own, memfit's come before it
            return _guarded(lambda: estimate_script.run(*found))
    args = _parser().parse_args(argv)
    args.argv = words  # as given: `train --nproc-per-node` relaunches it
    return _guarded(lambda: _verb(args.command, _VERBS[args.command][2])(args))


def _guarded(work) -> int:
    """``work()``'s exit status; memfit's errors one line and status 2, an interrupt 130."""
    from memfit.cli import _noise

    try:
        with _noise.quiet():
            return work()
    except MemfitError as err:
        print(f"memfit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `memfit ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
