"""The README and the docs site: short README whose links resolve, a site that builds strictly, command outputs
that match a fresh run, and every section of the old one-file manual with a home in docs/."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGENERATE = DOCS / "regenerate.py"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")

# Each section of the README before issue 38 (2,509 lines: every verb's manual) -> its page, and a sentence of
# it that must still be there, so a section cannot be dropped by a later edit unnoticed.
OLD_SECTIONS = [
    (None, "index.md", "memfit runs one full training step"),
    ("What `estimate` answers", "estimate.md", "The answer is the GPU's by default (issue 33)"),
    ("Any model you name: Hub ids, local checkpoints, quantised checkpoints", "models.md",
     "A Hub id resolves through `huggingface_hub` for `config.json` only"),
    ("Does it fit? What torch would do on your card", "estimate.md", "**Paged optimizer state is its own figure.**"),
    ("What `fit` answers: the largest batch that fits my card", "fit.md",
     "How: the planner's prime-batch traces make the live bytes after every event affine"),
    ("Past one card: what each rank of an FSDP2 or DDP run holds", "many-gpus.md", "Two things the real runs taught"),
    ("`device_map`: where Accelerate puts each layer, and what each GPU then holds", "device-map.md",
     "What the trace shows that the weight arithmetic does not"),
    (None, "mesh.md", "**Interleaved 1F1B** (`--pp-schedule interleaved-1f1b`)"),
    (None, "mesh.md", "**Context parallel** (`--cp N [--cp-rotate allgather|alltoall]`"),
    ("Packed and variable-length batches", "packed.md", "The estimate is for the **worst micro-batch**."),
    ("From your trainer's config and back: `memfit estimate --from`, `memfit plan --emit`", "trainer-configs.md",
     "An accelerate config YAML (what `accelerate config` writes)"),
    ("`memfit ui`: the answers on a page", "ui.md", "Measured on 2 cores: the page is up in 7 s"),
    ("Recipes: every technique as one composable value", "recipes.md",
     "A technique is one module of `src/memfit/techniques/` that declares itself"),
    ("What `plan` answers", "plan.md", "How: one trace per graph (precision, LoRA, checkpointing kind, offload"),
    ("`memfit train`: training inside the budget", "train.md", "The first run (same day, before the fixes) found"),
    ("On many processes: torchrun, FSDP2 or DDP, OOMs survived in lockstep", "train.md",
     "Pending on a GPU: the same code on one GPU with NCCL"),
    ("Watching real runs: `memfit profile`, pictures and the leak finder", "profile.md",
     "The watcher is the ledger that traces estimates, on your real tensors."),
    ("`memfit doctor`: why it ran out, and the fixes ranked by the bytes they save", "doctor.md",
     "Each **fix** is a full estimate, not a rule of thumb"),
    ("Inference memory: `generate` on fake tensors", "generate.md", "The one miss, **qwen2-moe-bf16 at −1.66 %**"),
    ("Against published `generate` figures", "generate.md",
     "Short prompt, where the weights are the peak: within 2.4 % on all three formats."),
    ("Serving: how many requests fit a card", "serve-plan.md", "The formula promises a ninth request that does not fit"),
    ("How it works, and what it does not see", "how-it-works.md",
     "A CUDA build of torch cannot do this by itself without a GPU"),
    ("Measured results", "results.md", "Why rows miss (or missed) by more than 10 %, by cause:"),
    ("Files", "files.md", "reads the import graph and fails otherwise"),
]


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"^(https?:|mailto:|#)", t)]


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_readme_is_one_screen_of_answers_and_its_links_resolve():
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: the manual is docs/, the README at most 200"
    links = _relative_links(readme)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_opens_with_a_generated_gpu_example():
    first = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("<!-- memfit-run"))
    assert first.startswith("<!-- memfit-run[fast") and "--gpu " in first, first


@pytest.mark.parametrize("heading, page, sentence", OLD_SECTIONS, ids=[f"{p}:{s[:30]}" for _, p, s in OLD_SECTIONS])
def test_every_section_of_the_old_readme_has_a_home(heading, page, sentence):
    text = (DOCS / page).read_text()
    if heading is not None:
        assert re.search(rf"^#{{1,6}} {re.escape(heading)}$", text, re.M), f"docs/{page} lost the heading {heading!r}"
    assert sentence in text, f"docs/{page} lost {sentence!r}"


def test_every_marked_block_parses_and_fast_ones_are_few():
    listed = _run(str(REGENERATE), "--list", timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = listed.stdout.splitlines()
    assert any(row.startswith("fast  README.md:") for row in rows)
    pages = {row.split()[1].split(":")[0] for row in rows if row.startswith("fast")}
    assert len(pages) >= 6, pages  # one fast block on most task pages
    assert sum(row.startswith("fast") for row in rows) <= 12, "fast blocks run in every test session: keep them few"


def test_the_check_fails_on_a_stale_block_and_the_rewrite_fixes_it(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n<!-- memfit-run[fast]: memfit --version -->\n```text\n$ memfit --version\nmemfit 0.0.0\n```\n")
    stale = _run(str(REGENERATE), "--check", str(page), timeout=120)
    assert stale.returncode == 1 and "differs" in stale.stdout, stale.stdout + stale.stderr
    assert page.read_text().count("memfit 0.0.0") == 1  # --check rewrites nothing
    assert _run(str(REGENERATE), str(page), timeout=120).returncode == 0
    assert "memfit 0.0.0" not in page.read_text() and "$ memfit --version\nmemfit " in page.read_text()
    fresh = _run(str(REGENERATE), "--check", str(page), timeout=120)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr


def _regenerate():
    spec = importlib.util.spec_from_file_location("regenerate", REGENERATE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["regenerate"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_fast_command_outputs_match_a_fresh_run():
    """Every fast block of README.md and docs/ against a fresh run (about 20 CPU s on 2 cores). When it fails, a
    default or a number changed: `make docs-regenerate` (or `python docs/regenerate.py`) rewrites the blocks.

    docs/regenerate.py's own ``--check --fast-only``, in regenerate's environment, with one change (this file run
    as a script, ``_check_in_forks``): each ``memfit ...`` command runs in a child forked from one process that
    has imported torch, transformers and memfit's verb modules, not in a process that imports them again (each
    fresh ``memfit`` paid ~3-4 CPU s of imports and ~2 s more loading its verb: 44 CPU s for 6 commands, now 19).
    Each child is still a fresh run: no command's state reaches another (each child starts from the parent's
    state, and the parent runs no command), the child runs ``memfit.cli:main`` (the ``memfit`` script's entry
    point) with its argv, writes to fds 1 and 2 (one file, as regenerate's one pipe) and exits as Python would
    (uncaught error printed, atexit handlers run). What the shared imports could hide, a line a library prints
    when imported, fails the check instead: the imports run under memfit's own noise filter and must print
    nothing. A command with shell syntax (a pipe) runs through regenerate's own ``bash -c``. regenerate's
    subprocess path itself is tested above (test_the_check_fails_on_a_stale_block_and_the_rewrite_fixes_it)."""
    done = subprocess.run([sys.executable, __file__, "--check", "--fast-only"], cwd=ROOT, env=_regenerate().environment(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


# What every fast command imports, imported once before the forks (any module missing here is imported by the
# child that needs it, as a fresh run would: slower, never different)
_PRELOADED = ("torch", "transformers", "accelerate", "peft", "torchao", "sympy", "rich.console", "rich.table",
              "torch._dynamo", "torch._inductor", "transformers.models.llama.modeling_llama", "memfit.report",
              "memfit.estimator.estimate", "memfit.cli.estimate", "memfit.cli.estimate_script", "memfit.cli.doctor",
              "memfit.cli.catalog")


def _written(work) -> str:
    """What ``work()`` (and any child it forks) writes to fds 1 and 2, read together as regenerate's pipe holds them."""
    import os
    import tempfile

    with tempfile.TemporaryFile() as sink:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(sink.fileno(), 1), os.dup2(sink.fileno(), 2)
        try:
            work()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        sink.seek(0)
        return sink.read().decode()


def _memfit_in_child(words: list[str]) -> None:
    """In the forked child: ``memfit WORDS`` as the console script runs it, then exit as Python would."""
    import atexit
    import os
    import traceback

    code = 1
    try:
        from memfit.cli import main

        sys.argv = ["memfit", *words]
        code = main()
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 0)


def _check_in_forks(argv: list[str]) -> int:
    """``docs/regenerate.py ARGV`` with each plain ``memfit ...`` command run in a forked child (see the test)."""
    import importlib
    import os
    import shlex

    regenerate = _regenerate()
    through_bash = regenerate.run

    def run(command: str) -> str:
        words = shlex.split(command)
        if words[:1] != ["memfit"] or any(c in command for c in "|&;<>$`()*?~"):
            return through_bash(command)

        def fork():
            pid = os.fork()
            if pid == 0:
                _memfit_in_child(words[1:])
            os.waitpid(pid, 0)

        output = _written(fork)
        if "Traceback (most recent call last)" in output:
            raise SystemExit(f"`{command}` raised:\n{output[-3000:]}")
        return output

    def preload():
        from memfit.cli import _noise

        with _noise.quiet():  # as a fresh `memfit` imports them: inside its noise filter
            for name in _PRELOADED:
                importlib.import_module(name)

    printed = _written(preload)
    if printed:
        raise SystemExit(f"importing {_PRELOADED} printed (a fresh run would show it in its block):\n{printed}")
    regenerate.run = run
    return regenerate.main(argv)


def _docs_tools() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ModuleNotFoundError:
            return module
    return None


@pytest.mark.skipif(_docs_tools() is not None,
                    reason=f"{_docs_tools()} is not installed: pip install -e '.[docs]' (make setup installs it)")
def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a warning fails it, a broken link or anchor among them (mkdocs.yml's validation),
    and a docstring the API page cannot render."""
    done = _run("-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "api" / "index.html").exists()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Estimate the memory of" in api  # the docstrings made it into the reference


if __name__ == "__main__":  # test_fast_command_outputs_match_a_fresh_run's process
    sys.exit(_check_in_forks(sys.argv[1:]))
