"""The command line follows the conventions: booleans settable both ways, tables within 80 columns,
NO_COLOR honoured, ``--version``, a quick ``--help`` that imports no torch, and a ``Report`` that
draws itself in a notebook."""

import json
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from importlib import metadata
from pathlib import Path

import pytest

from memfit.cli import _args, _parser, _recipe_flags, main
from memfit.report.report import Report
from memfit.units import format_size

VERBS = ("estimate", "fit", "plan", "train", "models", "gpus")
# SGR parameters that set a colour: 30-38 and 40-48 (38/48 start 256-colour and truecolour), 90-97, 100-107
COLOUR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-8]|4[0-8]|9[0-7]|10[0-7])(?:;[0-9;]*)?m")


def _recipe(tmp_path, text: str, *flags: str):
    (tmp_path / "r.yaml").write_text(text)
    args = _parser().parse_args(["estimate", "gpt2", "--recipe", str(tmp_path / "r.yaml"), *flags])
    return _args.recipe_from_args(args)


def test_a_no_flag_overrides_a_recipe_file_that_sets_it_true(tmp_path):
    text = "offload_activations: true\ncompile: layers\n"
    assert _recipe(tmp_path, text).offload_activations is True  # not given: the file's value stands
    recipe = _recipe(tmp_path, text, "--no-offload-activations", "--no-compile")
    assert (recipe.offload_activations, recipe.compile) == (False, False)
    recipe = _recipe(tmp_path, "set_to_none: false\n", "--set-to-none")
    assert recipe.set_to_none is True


def test_every_boolean_recipe_field_has_a_flag_for_each_way(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = capsys.readouterr().out
    for name, kind, _, _ in _args.recipe_fields():
        if kind == "bool":
            flag = name.replace("_", "-")
            assert f"--{flag}" in text and f"--no-{flag}" in text, flag


def test_the_static_flag_table_is_the_registry():
    """``_recipe_flags`` is written out so --help imports no torch; this keeps it the techniques' own."""
    from memfit.techniques.registry import fields

    assert _recipe_flags.FLAGS == tuple(_recipe_flags.row(f) for f in fields())
    assert _recipe_flags.render() == Path(_recipe_flags.__file__).read_text(encoding="utf-8"), \
        "regenerate: python -m memfit.cli._recipe_flags > src/memfit/cli/_recipe_flags.py"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"memfit {metadata.version('memfit')}\n"


@pytest.mark.parametrize("verb", ("", *VERBS))
def test_help_is_quick_and_imports_no_torch(verb):
    code = ("import sys\nfrom memfit.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *([verb] if verb else []), "--help"],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(f"memfit {verb} --help: {seconds:.2f} s")
    assert proc.returncode == 0 and "usage: memfit" in proc.stdout, proc.stderr
    assert proc.stderr.strip() == "False", "--help imported torch"
    assert seconds < 2.0  # about 0.1 s here; generous for a loaded CI machine


def _width(text: str) -> int:
    return max(len(line.rstrip()) for line in text.splitlines())


def test_gpus_fits_80_columns_one_line_a_card(monkeypatch, capsys):
    from memfit.hardware.gpus import CATALOG

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert _width(out) <= 80
    assert sum(line.startswith("│") for line in out.splitlines()) == len(CATALOG)  # no row wraps


@pytest.fixture(scope="module")
def estimated():
    """The text of ``memfit estimate gpt2`` at 80 columns, with NO_COLOR and without, both on a terminal
    (FORCE_COLOR). In this process: the environment is read as each call draws its table."""
    import contextlib
    import io

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "80")
        mp.setenv("FORCE_COLOR", "1")  # rich writes escapes as to a terminal
        for no_color in (False, True):
            if no_color:
                mp.setenv("NO_COLOR", "1")
            else:
                mp.delenv("NO_COLOR", raising=False)
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                code = main(["estimate", "gpt2", "--seq-len", "64", "--budget", "24GiB"])
            assert code == 0
            out[no_color] = text.getvalue()
    return out


def test_estimate_fits_80_columns(estimated):
    plain = re.sub(r"\x1b\[[0-9;]*m", "", estimated[True])
    assert "fits in" in plain and _width(plain) <= 80


def test_no_color_is_honoured(estimated, monkeypatch, capsys):
    assert COLOUR.search(estimated[False]), "the check sees colour where NO_COLOR is not set"
    assert not COLOUR.search(estimated[True])
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert main(["gpus"]) == 0
    assert not COLOUR.search(capsys.readouterr().out)


def test_nothing_hard_codes_colour_codes():
    src = Path(__file__).resolve().parent.parent / "src" / "memfit"
    for path in src.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\\x1b|\\033|\\u001b|\\e\[", text), path


class _Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.cells, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.cells.append(data)


def _report(**kw) -> Report:
    fields = dict(peak_bytes=3 * 2**30, by_category={"parameters": 2**30, "activations": 2 * 2**30, "batch": 0},
                  phase_peaks={"forward": 2 * 2**30, "backward": 3 * 2**30, "optimizer": 2**30}, step_peaks=[],
                  modules=[("model.layers.0.<mlp>", 2**29)], timeline=[], device="cpu", method="fake",
                  modelled_bytes=0, unprobed_ops=0, parameters=10**8, trainable=10**8,
                  notes=["a note with <tags> & ampersands"])
    return Report(**(fields | kw))


def test_report_draws_itself_as_html():
    report = _report()
    html = report._repr_html_()
    parser = _Cells()
    parser.feed(html)
    parser.close()
    text = " ".join(parser.cells)
    assert f"peak {format_size(report.peak_bytes)}" in text
    for word in ("parameters", "activations", "forward", "backward", "optimizer", "model.layers.0.<mlp>"):
        assert word in text
    assert "batch" not in text  # as str(report): categories with no bytes are left out
    assert "<tags>" in text and "<tags>" not in html  # escaped in the markup, itself in the text
    assert set(parser.tags) <= {"div", "p", "b", "i", "table", "caption", "thead", "tbody", "tr", "th", "td"}


def test_report_html_has_the_gpu_verdict():
    report = _report(reserved_bytes=4 * 2**30, context_bytes=2**29, gpu="rtx-4090", verdict="fits",
                     capacity_bytes=23 * 2**30)
    assert "fits: reserved 4.00 GiB" in report._repr_html_()
    assert json.dumps(report.to_dict())  # still plain data


def test_fit_view_says_why_a_size_under_the_budget_does_not_fit():
    """``fit`` on a GPU rejects a size the allocator's replay cannot place even when its figure is under
    the budget (fragmentation, expandable segments): no "-1.59 GiB over"."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from memfit.report.tables import fit_view
    from memfit.techniques.recipe import Recipe

    found = SimpleNamespace(gpu="rtx-4090", micro_batch_size=98, grad_accum_steps=1, global_batch_size=98,
                            recipe=Recipe(micro_batch_size=98), device_bytes=23 * 2**30, budget_bytes=24 * 2**30,
                            allocated_bytes=21 * 2**30, reserved_bytes=22 * 2**30, next_bytes=22 * 2**30,
                            tokens_per_step=None, predicted_micro_batch_size=None, traces=0, estimates=3,
                            seconds=1.0, notes=())
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(fit_view(found, "gpt2"))
    text = console.export_text()
    assert "within the budget" in text and "over" not in text
