"""``memfit doctor``: why a run ran out of memory, and the fixes ranked by the bytes they save.

    memfit doctor --error train.log                             # the message alone (last one in the log)
    memfit doctor llama-3.2-1b --batch-size 8 --seq-len 4096 --error train.log    # with the step that failed
    pbpaste | memfit doctor llama-3.2-1b --error -              # the message on stdin
    memfit doctor --profile run.json                            # a saved `memfit profile --out` file
    memfit doctor --budget 300MiB -- python train.py --lr 1e-4  # run the script under a CPU virtual budget

The cause is one word of ``memfit.profiling.doctor.CAUSES``; the rules and the ranking are that module's.
With ``-- python script.py`` the script runs inside ``memfit.profile()`` (``profiling/profile.py``) under a
virtual budget of ``--budget`` (CPU tensors; without ``--budget`` on the device as it is), and what it
saw is diagnosed: leaks, evaluation with grad enabled and long batches can only be told this way.

Exit status: 0 a cause was found and a fix that fits; 3 a cause was found (or not: ``unknown``) but no
fix fits; 4 no out-of-memory error in the input (or the script ran without one); 2 bad input.
"""

from __future__ import annotations

import json
import os
import sys

from memfit.cli import _args
from memfit.errors import MemfitError

__all__ = ["build", "run"]

EXIT_HELP = ("exit status: 0 diagnosed and a fix that fits found; 3 diagnosed but no fix fits (or the cause is "
             "unknown); 4 no out-of-memory error in the input; 2 bad input")
CAUSES_HELP = ("causes: model_states, activations, optimizer_temporaries, fragmentation, other_process, leak, "
               "eval_without_no_grad, long_batch, unknown")


def build(parser) -> None:
    parser.usage = "%(prog)s [MODEL] [--error FILE|TEXT|- | --profile FILE] [flags] [-- python SCRIPT.py ARGS]"
    parser.description = ("Name the cause of an out-of-memory error (the message, a log, a profile, or a script "
                          "run under a budget) and rank the fixes by the bytes they save.")
    parser.epilog = f"{CAUSES_HELP}. {EXIT_HELP}. Run a script: memfit doctor --budget 300MiB -- python train.py ARGS"
    model = _args.section(parser, "model")
    model.add_argument("model", nargs="?", default=None,
                       help="the model that ran out, as for estimate: each fix is then checked by an estimate "
                            "(optional)")
    model.add_argument("--revision", default=None, help="with a Hub id: the branch, tag or commit to read (default main)")
    model.add_argument("--trust-remote-code", action="store_true", help="run the repository's own model code")
    error = _args.section(parser, "error")
    error.add_argument("--error", default=None, metavar="FILE|TEXT|-",
                       help="torch's out-of-memory message: a log file (its last one counts), the text, or - for stdin")
    error.add_argument("--profile", default=None, metavar="FILE",
                       help="a memfit profile JSON (memfit profile script.py --out F)")
    error.add_argument("--steps", type=int, default=0, metavar="N",
                       help="with -- python script.py: optimizer steps to watch, then stop it (default 0: to its end)")
    _args.section(parser, "batch").add_argument("--batch-size", type=_args.positive, default=None, metavar="N",
                                                help="examples per optimizer step of the run that failed (default 1)")
    _args.add_seq_len(parser)
    _args.add_recipe(parser)
    _args.recipe_flags(parser)
    _args.add_gpu(parser, help="the catalog card it ran on (default: the one whose memory is the message's capacity)")
    _args.add_budget(parser, help="what the process could use, e.g. 24GiB (default: from the message); with -- "
                     "python: a CPU cap")
    planning = _args.section(parser, "planning")
    planning.add_argument("--allow", default="", metavar="NAMES", help="fixes that change the math, by name: "
                          f"{','.join(_args.allowable())} (default none)")
    planning.add_argument("--no-plan", dest="plan", action="store_false",
                          help="leave out memfit plan's recipe (a search: saves tens of seconds)")
    _args.add_json(parser, help="print the diagnosis as JSON: cause, summary, figures, fixes (ranked), exit_code")
    _split_at_dashes(parser)


def _split_at_dashes(parser) -> None:
    """Everything after ``--`` is the command to run (``args.script``), never the verb's own arguments:
    argparse alone would read ``python`` as the model."""
    parse = parser._parse_known_args

    def split(arg_strings, namespace, *rest, **kwargs):
        arg_strings = list(arg_strings)
        command = []
        if "--" in arg_strings:
            cut = arg_strings.index("--")
            arg_strings, command = arg_strings[:cut], arg_strings[cut + 1:]
        namespace, extra = parse(arg_strings, namespace, *rest, **kwargs)
        namespace.script = command
        return namespace, extra

    parser._parse_known_args = split


def run(args) -> int:
    from memfit.profiling.doctor import EXIT_NO_OOM, NoOomFound, diagnose

    command = getattr(args, "script", [])
    if args.error is None and args.profile is None and not command:
        raise MemfitError("memfit doctor needs the error: --error LOG (or - for stdin), --profile FILE, or "
                          "-- python train.py to run it under a budget")
    error = _error_text(args.error)
    profile = _profile_file(args.profile) if args.profile else None
    if command:
        if profile is not None:
            raise MemfitError("--profile and -- python script.py conflict: the script's own profile is diagnosed")
        profile, message, ran = _profiled(command, args)
        error = message if error is None else error
    recipe = _args.recipe_from_args(args)
    model = _args.model_of(args) if args.model is not None else None
    batch, label = None, args.model
    if model is None and command and ran is not None:  # the script's own model, on a batch of its shapes
        model, batch, label = ran, _batch_of(profile), ""  # "": the fixes say what to apply in the script
        model = model if batch is not None else None
    try:
        with _args.progress("diagnosing"):
            found = diagnose(error, profile=profile, model=model, batch=batch, recipe=recipe,
                             batch_size=args.batch_size if batch is None else None, seq_len=args.seq_len,
                             gpu=args.gpu, budget=args.budget, allow=args.allow, plan=args.plan, label=label)
    except NoOomFound as err:
        if args.json:
            print(json.dumps({"cause": None, "summary": str(err), "figures": {}, "fixes": [],
                              "exit_code": EXIT_NO_OOM}, indent=2))
        else:
            print(f"memfit: {err}", file=sys.stderr)
        return EXIT_NO_OOM
    if args.json:
        print(json.dumps(found.to_dict(), indent=2))
    else:
        from rich.console import Console

        Console().print(_view(found))
    return found.exit_code


def _error_text(error: str | None) -> str | None:
    if error is None:
        return None
    if error == "-":
        return sys.stdin.read()
    if os.path.isfile(error):
        try:
            with open(error, encoding="utf-8", errors="replace") as log:
                return log.read()
        except OSError as err:
            raise MemfitError(f"cannot read --error {error}: {err.strerror or err}") from None
    if os.path.isdir(error):
        raise MemfitError(f"--error {error} is a directory: name the log file, paste the message, or - for stdin")
    return error  # the message itself


def _profile_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise MemfitError(f"cannot read --profile {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise MemfitError(f"--profile {path} is not JSON ({err.msg}, line {err.lineno}): write it with "
                          "memfit profile script.py --out FILE") from None
    if not isinstance(data, dict):
        raise MemfitError(f"--profile {path} is not a memfit profile (a JSON object)")
    return data


def _profiled(command: list[str], args) -> tuple[dict, str | None]:
    """Run ``python script.py args`` (or ``-m module``) inside ``memfit.profile()``; its profile as a dict,
    and the out-of-memory message it ended with (None if it did not run out)."""
    from memfit.script import runner
    from memfit.profiling.profile import Enough, profile

    words = list(command)
    if words and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
    as_module = bool(words) and words[0] == "-m"
    words = words[1:] if as_module else words
    if not words:
        raise MemfitError("after --, the command to run: python train.py [its arguments] (or python -m package.module)")
    if not as_module and not os.path.isfile(words[0]):
        raise MemfitError(f"no script {words[0]!r}: give the path of a Python file (or python -m package.module)")
    if args.steps < 0:
        raise MemfitError(f"--steps must be 0 (run to the end) or more, got {args.steps}")
    prof = profile(device="cpu" if args.budget is not None else None, max_steps=args.steps or None,
                   budget=args.budget)
    failed = None
    with _quiet_stdout(args.json):
        try:
            with prof:
                runner.run(runner.Target(words, as_module))
        except Enough:  # pragma: no cover (the block swallows it)
            pass
        except Exception as err:  # noqa: BLE001 — the script's own error: the profile up to it is what is read
            # its text only: the exception kept would hold its traceback, whose frames (the script's, the
            # profile's dispatch) hold the script's model and tensors in a cycle that only the collector frees,
            # and a later profile in this process would count them as resident (a leak between two doctor runs)
            failed = f"{type(err).__name__}: {err}".splitlines()[0]
    data = prof.to_dict()
    if failed is not None and prof.oom is None:
        print(f"memfit: the script failed, not out of memory: {failed}", file=sys.stderr)
    return data, None if prof.oom is None else prof.oom.get("message"), prof.watch.model


def _batch_of(profile: dict):
    """A batch shaped as the script's model was called in the step that ran out: zeros of each keyword
    tensor's shape and dtype (token ids 0 are valid ids and labels). None when the model took positional
    tensors (then memfit cannot tell the loss) or no call was seen."""
    import torch

    inputs = profile.get("inputs") or []
    if not inputs or not inputs[-1].get("kwargs") or any(a is not None for a in inputs[-1].get("args", [])):
        return None
    return {name: torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]))
            for name, spec in inputs[-1]["kwargs"].items()}


def _quiet_stdout(to_stderr: bool):
    import contextlib

    return contextlib.redirect_stdout(sys.stderr) if to_stderr else contextlib.nullcontext()


def _view(found):
    """The cause in one line, the ranked fixes in a table within 80 columns, each fix's command below."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from memfit.units import format_size

    lines = [Text(f"cause: {found.cause}", style="bold red" if found.cause != "unknown" else "bold"),
             Text(found.summary)]
    if found.fixes:
        lines.append(Text("fixes, ranked: those that fit first, then the faster, then the more bytes saved"))
        table = Table()
        for column, justify in (("#", "right"), ("fix", "left"), ("saves", "right"), ("fits", "left"),
                                ("speed", "right")):
            table.add_column(column, justify=justify)
        for k, fix in enumerate(found.fixes, 1):
            saves = "?" if fix.saves_bytes is None else format_size(fix.saves_bytes)
            fits = "?" if fix.fits is None else "yes" if fix.fits else "no"
            speed = "-" if fix.speed_cost is None else f"{fix.speed_cost:.2f}x"
            name = fix.name + (" (changes math)" if fix.changes_math else "")
            table.add_row(str(k), name, saves, fits, speed, style="bold green" if k == 1 and fix.fits else None)
        lines.append(table)
        lines += [Text(f"{k}. {fix.command or fix.why}") for k, fix in enumerate(found.fixes, 1)]
    else:
        lines.append(Text("no fix to offer from this evidence", style="yellow"))
    lines += [Text(f"note: {note}", style="dim") for note in found.notes]
    return Group(*lines)

