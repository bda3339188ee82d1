"""``memfit profile script.py [args]`` / ``memfit profile -m module [args]``: a real run's memory.

The script runs as ``python script.py args`` would (its ``__main__``, its ``sys.argv``, its directory
first on ``sys.path``) inside ``memfit.profile()``; steps are found by its optimizer's ``step``, so
the script needs no change. By default the first 10 steps are watched and the script is then stopped
(``--steps 0``: to its end). Exit status: 0, the script's own non-zero status, 1 when it raised (its
traceback printed as Python prints it; an out-of-memory error is one line and the profile up to it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from memfit.cli import _args
from memfit.errors import MemfitError


def build(parser) -> None:
    parser.usage = "%(prog)s [flags] SCRIPT.py [its args] | %(prog)s [flags] -m MODULE [its args]"
    script = _args.section(parser, "script")
    script.add_argument("-m", dest="as_module", action="store_true",
                        help="run a module (as python -m does) instead of a script file")
    script.add_argument("--steps", type=int, default=10, metavar="N",
                        help="optimizer steps to watch, then stop the script (default 10; 0: run it to its end)")
    _args.add_device(parser, None, help="whose tensors to count (default: cuda when available, else cpu; or mps)",
                     choices=("cpu", "cuda", "mps"))
    _args.add_budget(parser, help="CPU only: a virtual cap, e.g. 300MiB: allocations past it raise "
                                  "torch.OutOfMemoryError")
    output = _args.section(parser, "output")
    output.add_argument("--html", default=None, metavar="FILE",
                        help="write the interactive picture (self-contained HTML) here")
    output.add_argument("--png", default=None, metavar="FILE", help="write the picture as a PNG here")
    output.add_argument("--snapshot", default=None, metavar="FILE",
                        help="CUDA: write the allocator's raw snapshot here (PyTorch's memory_viz page opens it)")
    _args.add_out(parser, help="write the profile as JSON to this file")
    _args.add_json(parser, help="print the profile as JSON (the script's own output goes to stderr)")
    script.add_argument("target", nargs=argparse.REMAINDER,
                        help="the script and its arguments (or with -m, the module and its arguments)")


def run(args) -> int:
    from memfit.profiling.profile import Enough, profile

    target = args.target
    if target and target[0] == "--":
        target = target[1:]
    if not target:
        raise MemfitError("memfit profile needs a script: memfit profile train.py [its arguments] "
                          "(or -m package.module)")
    from memfit.script import runner

    what = runner.target(target[0], target[1:], module=args.as_module)
    if args.steps < 0:
        raise MemfitError(f"--steps must be 0 (run to the end) or more, got {args.steps}")
    _warn_misplaced(target, args.as_module)
    for flag, path in (("--html", args.html), ("--png", args.png), ("--out", args.out), ("--snapshot", args.snapshot)):
        _args.check_file(flag, path)
    if args.html or args.png:
        from memfit.report.pictures import require

        require()
    if args.snapshot and (args.device or "cuda") != "cuda":
        raise MemfitError("--snapshot is the CUDA allocator's history: profile with --device cuda on a GPU")
    status, failed = 0, None
    sink = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    prof = profile(device=args.device, max_steps=args.steps or None, budget=args.budget)
    with sink:
        try:
            with prof:
                status = runner.run(what)
        except Enough:  # pragma: no cover (the block swallows it)
            pass
        except BaseException as err:  # the script's own error: shown as Python shows it, after the profile
            if isinstance(err, KeyboardInterrupt):
                raise
            failed = err
    data = prof.to_dict()
    data["script"] = {"argv": target, "module": args.as_module, "exit_status": status,
                      "error": None if failed is None else f"{type(failed).__name__}: {failed}".splitlines()[0]}
    _write(prof, data, args)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(_text(prof, data))
    if failed is not None:
        import torch

        if isinstance(failed, torch.OutOfMemoryError):
            print(f"memfit: the script ran out of memory at step {prof.oom['step'] + 1} ({prof.oom['phase']}): "
                  f"{prof.oom['message']}; `memfit doctor --profile` on this profile's --out explains it",
                  file=sys.stderr)
        else:
            print(runner.traceback_text(failed), end="", file=sys.stderr)
        # the exception's traceback holds this frame (and the script's, with its model): no cycle left to the
        # collector, so a later profile in this process does not count them as resident (cli/doctor.py)
        failed = None
        return 1
    return status


def _own_flags() -> dict[str, bool]:
    """memfit profile's own flags that take part in a profile (not ``--help``, nor ``-m``, which names what
    follows it): whether each takes a value."""
    parser = argparse.ArgumentParser(add_help=False)
    build(parser)
    return {flag: action.nargs != 0 for action in parser._actions for flag in action.option_strings if flag != "-m"}


def _warn_misplaced(target: list[str], as_module: bool) -> None:
    """One line on stderr when memfit profile's own flags follow the script: they are the script's
    arguments (as ``python train.py --json`` would pass them), not memfit's. The script gets them unchanged."""
    own, found, i = _own_flags(), [], 1
    while i < len(target):
        word = target[i]
        if word == "--":  # what follows is plainly the script's
            break
        flag = word.split("=", 1)[0]
        if flag in own:
            takes = own[flag] and "=" not in word and i + 1 < len(target)
            found.append((word, target[i + 1] if takes else None))
            i += 1 if takes else 0
        i += 1
    if not found:
        return
    flags = " ".join(flag.split("=", 1)[0] for flag, _ in found)
    moved = " ".join(f"{flag} {value}" if value is not None else flag for flag, value in found)
    script = f"-m {target[0]}" if as_module else target[0]
    rest = " ..." if len(target) - 1 > sum(1 + (v is not None) for _, v in found) else ""
    print(f"memfit: warning: {flags} after {target[0]} went to {target[0]}'s argv, not to memfit profile; for "
          f"memfit, write them before it: `memfit profile {moved} {script}{rest}`", file=sys.stderr)


def _write(prof, data, args) -> None:
    if args.out:
        with open(args.out, "w") as out:
            json.dump(data, out, indent=2, default=str)
    if args.html or args.png:
        from memfit.report import pictures

        if args.html:
            pictures.write_html(prof.report, args.html, title="memfit profile")
        if args.png:
            pictures.write_png(prof.report, args.png, title="memfit profile")
    if prof.snapshot is not None and (args.snapshot or args.html):  # beside the picture, for memory_viz
        from memfit.profiling.cuda_snapshot import save

        args.snapshot = args.snapshot or os.path.splitext(args.html)[0] + ".snapshot.pickle"
        save(prof.snapshot, args.snapshot)
    for path in (args.out, args.html, args.png, args.snapshot):
        if path:
            print(f"wrote {path}", file=sys.stderr)


def _text(prof, data) -> str:
    from memfit.units import format_size

    lines = [str(prof.report)]
    if data["steps"]:
        lines.append("steps: " + ", ".join(f"{s['step']}: {format_size(s['peak_bytes'])}" for s in data["steps"]))
    if data["leaks"]:
        lines.append("leaks (memory that grows step after step):")
        lines += [f"  {format_size(leak['bytes_per_step']):>12}/step  {leak['site']}  ({leak['category']}, "
                  f"{leak['steps']} steps)" for leak in data["leaks"]]
    elif prof.steps >= 4:
        lines.append("leaks: none")
    for fwd in data["forwards_without_backward"][:3]:
        lines.append(f"a forward at {fwd['site']} (step {fwd['step'] + 1}) saved {format_size(fwd['bytes'])} for a "
                     "backward that never came: wrap evaluation in torch.no_grad()")
    return "\n".join(lines)
