"""``memfit estimate [flags] SCRIPT.py [its args]`` / ``memfit estimate [flags] -m MODULE [its args]``: a user's own
training script, estimated for a card on fake tensors (``memfit.script``).

memfit's flags come before the script; everything after it is the script's, exactly as ``python SCRIPT.py args``
would see it. ``main`` sends ``estimate`` here when its arguments name a ``.py`` file or ``-m`` (``split``).
Exit status: 0; 2 on bad input, when the script raised (its traceback as Python prints it, then one line), ran
no optimizer step, or called something fake tensors cannot run (one line naming its file:line).
"""

from __future__ import annotations

import argparse
import json
import sys

from memfit.cli import _args
from memfit.errors import MemfitError

__all__ = ["split", "build", "run"]


def split(argv: list[str]) -> tuple[list[str], list[str], bool] | None:
    """(memfit's words, the script's argv, whether it is ``-m``) of ``estimate``'s arguments, or None when
    they name no script: the first word ending in ``.py`` (or the word after ``-m``) starts the script's."""
    for i, word in enumerate(argv):
        if word == "--":
            return None
        if word == "-m" and i + 1 < len(argv):
            return argv[:i], argv[i + 1:], True
        if word.endswith(".py") and not word.startswith("-") and (i == 0 or argv[i - 1] not in _VALUED):
            return argv[:i], argv[i:], False
    return None


# estimate's flags whose value could end in .py (none should; a factory is package.module:function)
_VALUED = {"--recipe", "--from", "--batch", "--loss", "--out", "--html", "--png", "--lengths"}


def build(parser) -> None:
    _args.add_gpu(parser, help="the card the script's 'cuda' is, e.g. rtx-4090 (default: the GPU torch sees, else "
                  "h100-sxm)")
    many = _args.section(parser, "parallel")
    many.add_argument("--gpus", type=_args.positive, default=1, metavar="N",
                      help="GPUs per node (default 1): more runs the script as one rank of torchrun, on a fake group")
    many.add_argument("--nodes", type=_args.positive, default=1, metavar="N", help="nodes of that torchrun launch "
                      "(default 1)")
    many.add_argument("--rank", type=int, default=0, metavar="N", help="the rank estimated (default 0)")
    _args.add_device(parser, None, help="cuda (default: the card's allocator and verdict) | cpu (as on a CPU-only "
                     "machine)")
    _args.section(parser, "script").add_argument(
        "--steps", type=int, default=2, metavar="N",
        help="optimizer steps to run, then stop the script (default 2: step 2 has optimizer state; 0: to its end)")
    _args.add_budget(parser, help="bytes the process may use on the card, e.g. 20GiB (default: the whole card)")
    _args.add_json(parser, help="print the report as JSON (the script's own output goes to stderr)")
    _args.add_out(parser, help="also write the JSON report to this file")
    output = _args.section(parser, "output")
    output.add_argument("--html", default=None, metavar="FILE", help="also draw the report as one interactive page")
    output.add_argument("--png", default=None, metavar="FILE", help="also draw the report as a PNG")


def run(words: list[str], script: list[str], module: bool) -> int:
    parser = _ScriptParser(prog="memfit estimate",
                           usage="memfit estimate [flags] SCRIPT.py [its args] | -m MODULE [its args]")
    build(parser)
    args = parser.parse_args(words)
    if args.steps < 0:
        raise MemfitError(f"--steps must be 0 (run to the end) or more, got {args.steps}")
    for flag, path in (("--html", args.html), ("--png", args.png), ("--out", args.out)):
        _args.check_file(flag, path)
    if args.html or args.png:
        from memfit.report.pictures import require

        require()
    import contextlib

    from memfit.script import ScriptFailed, estimate_script

    sink = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with sink:
            report = estimate_script(script[0], script[1:], module=module, gpu=args.gpu, device=args.device,
                                     gpus=args.gpus, nodes=args.nodes, rank=args.rank, steps=args.steps,
                                     budget=args.budget)
    except ScriptFailed as failed:
        if failed.error is not None:
            from memfit.script.runner import traceback_text

            print(traceback_text(failed.error), end="", file=sys.stderr)
        raise MemfitError(str(failed)) from None
    data = report.to_dict()
    if args.out:
        with open(args.out, "w") as out:
            json.dump(data, out, indent=2, default=str)
    if args.html or args.png:
        from memfit.report import pictures

        if args.html:
            pictures.write_html(report, args.html, title=f"memfit estimate {script[0]}")
        if args.png:
            pictures.write_png(report, args.png, title=f"memfit estimate {script[0]}")
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        from rich.console import Console

        from memfit.report.tables import report_view

        console = Console()
        console.print(report_view(report, script[0], args.budget))
        for line in lines(report):
            console.print(line, style="bold", highlight=False, markup=False)
    return 0


def lines(report) -> list[str]:
    """The script's own lines: where the peak happens and, on OOM, where the allocation would fail."""
    from memfit.units import format_size

    lines = []
    script = report.settings.get("script", {})
    peak = script.get("peak")
    if peak:
        lines.append(f"peak at {peak['site']}: {peak['code']}")
    oom = script.get("oom")
    if oom and oom.get("site"):
        lines.append(f"out of memory at {oom['site']}: {oom['code']} (a {format_size(oom['request_bytes'])} "
                     f"request; {format_size(oom['missing_bytes'] or 0)} short)")
    return lines


class _ScriptParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"memfit estimate: error: {MemfitError(message)} (memfit's flags go before the script; "
                     f"see memfit estimate --help)\n")
