"""Regenerate every command output shown in README.md and docs/*.md, so none can drift from the code.

A generated block is a fenced ``text`` block with a marker comment on the line before it:

    <!-- memfit-run[fast]: memfit estimate llama-3.2-1b --gpu rtx-4090 --seq-len 2048 -->
    ```text
    $ memfit estimate llama-3.2-1b --gpu rtx-4090 --seq-len 2048
    ...what the command printed...
    ```

The script runs the marker's command and writes the block: a ``$ command`` line, then the output. Options go
in the brackets, comma-separated:

    fast | slow    required. fast: a few seconds on a CPU; ``--check --fast-only`` (tests/test_docs.py) runs
                   these. slow: a big model or a search (tens of seconds to minutes); only a full run
                   regenerates them (docs/models.md's pipes its JSON through ``jq``)
    from=REGEX     keep the output from the first line matching REGEX (the rest of the report is on the page)
    head=N         keep the first N lines, then a ``...`` line

    python docs/regenerate.py                      # run every marked block, rewrite the files
    python docs/regenerate.py --fast-only          # only the fast ones
    python docs/regenerate.py --check [--fast-only]  # rewrite nothing; exit 1 naming each block that differs
    python docs/regenerate.py --list               # the marked blocks, with their files and lines
    python docs/regenerate.py docs/estimate.md     # only the files named

What makes the output the same on every machine (each set here, not taken from the caller's environment):
the command runs through ``bash -c`` in the repository root with the running Python's ``bin/`` (the venv's
``memfit``) first on PATH; ``COLUMNS=100`` (rich wraps at the width, so lines are as printed in a 100-column
terminal); ``NO_COLOR=1`` and ``TERM=dumb`` (no escapes); ``CUDA_VISIBLE_DEVICES=""`` (no GPU is seen, so a
command without ``--gpu`` answers for memfit's default card, as on a machine without one); ``MEMFIT_DEVICE``
removed (the tests set it to cpu); ``HF_HUB_OFFLINE=1`` (no network). stdout and stderr are read together.
Normalised: trailing spaces (rich pads table titles to the table's width), trailing blank lines, and the
repository's absolute path (written ``.``), and the timings in ``TIMINGS`` below (the planning seconds of ``memfit plan``
and ``memfit fit``, written ``...``). A command whose output is mostly timings (``memfit train``'s progress) is not
marked: its outputs in the docs are quoted from the runs and benches they name.

Blocks without a marker are not touched: measurements quoted from a GPU, a real training run or a bench
(their command is named beside them; the numbers are those the bench wrote in bench/results/).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- memfit-run\[(?P<opts>[^\]]*)\]: (?P<cmd>.+?) -->$")
COLUMNS = 100
#: timings a command prints, written ``...`` (the only normalisation beyond whitespace and paths): the planning
#: seconds in the title of ``memfit plan``'s front and at the end of ``memfit fit``'s answer
TIMINGS = [(re.compile(r"(\d[\d,]* candidates, )\d+(?:\.\d+)? s\b"), r"\1... s"),
           (re.compile(r"( from \d+ traces, )\d+(?:\.\d+)? s\b"), r"\1... s"),
           (re.compile(r"(\d+ full estimate\(s\), )\d+(?:\.\d+)? s\b"), r"\1... s")]  # fit --longest


@dataclass
class Block:
    path: Path
    line: int  # 0-based index of the marker line
    command: str
    fast: bool
    start: int  # index of the opening fence
    end: int  # index of the closing fence
    options: dict

    def where(self) -> str:
        return f"{_shown(self.path)}:{self.line + 1}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def parse_options(text: str, where: str) -> dict:
    options: dict = {}
    for part in (p.strip() for p in text.split(",")):
        if part in ("fast", "slow"):
            options["speed"] = part
        elif part.startswith("from="):
            options["from"] = part[len("from="):]
        elif part.startswith("head="):
            options["head"] = int(part[len("head="):])
        else:
            raise SystemExit(f"{where}: unknown option {part!r} (fast, slow, from=REGEX, head=N)")
    if "speed" not in options:
        raise SystemExit(f"{where}: say fast or slow in the marker")
    return options


def find_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        found = MARKER.match(line)
        if not found:
            if line.startswith("<!-- memfit-run"):
                raise SystemExit(f"{_shown(path)}:{i + 1}: a marker that does not parse: {line}")
            continue
        where = f"{_shown(path)}:{i + 1}"
        if i + 1 >= len(lines) or lines[i + 1] != "```text":
            raise SystemExit(f"{where}: a marker must be followed by a ```text fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise SystemExit(f"{where}: the block's fence is never closed")
        options = parse_options(found["opts"], where)
        blocks.append(Block(path, i, found["cmd"], options["speed"] == "fast", i + 1, end, options))
    return blocks


def documents() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MEMFIT_DEVICE"}
    bin_dir = str(Path(sys.executable).parent)  # the venv's bin (not resolved: a venv's python is a symlink)
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), COLUMNS=str(COLUMNS), LINES="50", NO_COLOR="1",
               TERM="dumb", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore")
    env.pop("FORCE_COLOR", None)
    return env


def run(command: str) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    if "Traceback (most recent call last)" in done.stdout:
        raise SystemExit(f"`{command}` raised:\n{done.stdout[-3000:]}")
    return done.stdout


def normalise(output: str, options: dict) -> list[str]:
    lines = [line.rstrip().replace(str(ROOT), ".") for line in output.splitlines()]
    for pattern, text in TIMINGS:
        lines = [pattern.sub(text, line) for line in lines]
    if "from" in options:
        pattern = re.compile(options["from"])
        first = next((i for i, line in enumerate(lines) if pattern.search(line)), None)
        if first is None:
            raise SystemExit(f"no line matches from={options['from']!r} in:\n" + "\n".join(lines))
        lines = lines[first:]
    if "head" in options and len(lines) > options["head"]:
        lines = lines[:options["head"]] + ["..."]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def rendered(block: Block, cache: dict) -> list[str]:
    if block.command not in cache:
        started = time.monotonic()
        cache[block.command] = run(block.command)
        print(f"  {time.monotonic() - started:5.1f} s  {block.where()}  {block.command}", file=sys.stderr)
    return [f"$ {block.command}"] + normalise(cache[block.command], block.options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="regenerate the command outputs shown in README.md and docs/")
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a block differs")
    parser.add_argument("--fast-only", action="store_true", help="only the blocks marked fast")
    parser.add_argument("--list", action="store_true", help="list the marked blocks and exit")
    parser.add_argument("paths", nargs="*", type=Path, help="only these Markdown files (default: README.md, docs/)")
    args = parser.parse_args(argv)

    cache: dict = {}
    differ = []
    for path in [p.resolve() for p in args.paths] or documents():
        blocks = find_blocks(path)
        if args.list:
            for block in blocks:
                print(f"{'fast' if block.fast else 'slow'}  {block.where()}  {block.command}")
            continue
        lines = path.read_text().splitlines()
        changed = False
        for block in reversed(blocks):  # from the end, so earlier indices stay valid
            if args.fast_only and not block.fast:
                continue
            new = rendered(block, cache)
            old = lines[block.start + 1:block.end]
            if new != old:
                differ.append((block, old, new))
                lines[block.start + 1:block.end] = new
                changed = True
        if changed and not args.check:
            path.write_text("\n".join(lines) + "\n")
    for block, old, new in reversed(differ):
        print(f"{block.where()}: {'differs' if args.check else 'rewritten'}: {block.command}")
        if args.check:
            print("\n".join(list(difflib.unified_diff(old, new, "committed", "fresh run", lineterm=""))[:40]))
    if args.check and differ:
        print(f"{len(differ)} block(s) differ from a fresh run: python docs/regenerate.py "
              f"{'--fast-only ' if args.fast_only else ''}rewrites them")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
