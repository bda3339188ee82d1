"""Every verb's ``--help`` reads in sections (``_args.SECTIONS``): each flag sits in a named group, has a
one-line help under 100 characters and is documented in docs/*.md; and the spellings people type for a flag's
value (``--lora 16``, ``--checkpointing full``, ``--parallel FSDP``) read as what they mean
(``cli/_spellings.py``), while bad input is still one line and exit status 2."""

import argparse
import re
from pathlib import Path

import pytest

from memfit.cli import _VERBS, _args, _parser, _recipe_flags, estimate_script, main

DOCS = "\n".join(path.read_text(encoding="utf-8") for path in (Path(__file__).parent.parent / "docs").glob("*.md"))
LONGEST = 100  # characters of a flag's help, as argparse prints it


def _verbs() -> dict:
    """Every verb's parser, built, and the script form of estimate (``memfit estimate SCRIPT.py``)."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {}
    for name, parser in sub.choices.items():
        parser.format_help()  # builds its flags
        parsers[name] = parser
    script = argparse.ArgumentParser(prog="memfit estimate")
    estimate_script.build(script)
    parsers["estimate SCRIPT.py"] = script
    return parsers


def problems(parser) -> list[str]:
    """What keeps ``parser``'s --help from reading in sections: a flag (or positional) outside a named section,
    a help that is missing, on several lines or over LONGEST characters."""
    formatter = parser._get_formatter()
    sections = set(_args.SECTIONS.values())
    found = []
    for group in parser._action_groups:
        for action in group._group_actions:
            name = "/".join(action.option_strings) or action.dest
            if action.option_strings == ["-h", "--help"]:
                continue
            if group.title not in sections:
                found.append(f"{name} sits in {group.title!r}, not a section of _args.SECTIONS")
            text = formatter._expand_help(action) if action.help else ""
            if not text or "\n" in text or len(text) > LONGEST:
                found.append(f"{name}'s help is not one line of at most {LONGEST} characters: {text!r}")
    return found


def undocumented(parser) -> list[str]:
    flags = {flag for action in parser._actions for flag in action.option_strings} - {"-h", "--help"}
    return sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", DOCS))


VERBS = _verbs()


def test_every_verb_is_checked():
    assert set(_VERBS) | {"estimate SCRIPT.py"} == set(VERBS)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_flag_sits_in_a_section_with_one_line_of_help(verb):
    assert problems(VERBS[verb]) == []


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_flag_is_documented(verb):
    assert undocumented(VERBS[verb]) == [], "name each in docs/*.md (the Recipe's flags: docs/recipes.md)"


def test_the_checks_can_fail():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loose", help="in argparse's own group")
    _args.section(parser, "model").add_argument("--long", help="x" * (LONGEST + 1))
    _args.section(parser, "model").add_argument("--bare")
    _args.section(parser, "model").add_argument("--lines", help="one\ntwo")
    found = problems(parser)
    assert [line.split()[0] for line in found] == ["--loose", "--long's", "--bare's", "--lines's"], found
    assert undocumented(parser) == ["--bare", "--lines", "--long", "--loose"]
    assert undocumented(VERBS["estimate"]) == [] and "--lora" in DOCS  # the flags of a verb are found


def test_the_sections_print_in_one_order():
    text = VERBS["estimate"].format_help()
    titles = [title for title in _args.SECTIONS.values() if f"\n{title}:\n" in text]
    assert titles == sorted(titles, key=lambda title: text.index(f"\n{title}:\n"))
    assert titles[:3] == ["model", "recipe and config files", "batch and sequence"]


def test_every_recipe_field_has_its_section_and_a_help_with_its_default():
    assert set(_recipe_flags.CLI) == {name for name, *_ in _recipe_flags.FLAGS}
    for name, (section, help) in _recipe_flags.CLI.items():
        assert section in _args.SECTIONS and "default" in help, name


def _recipe(*flags: str):
    return _args.recipe_from_args(_parser().parse_args(["estimate", "gpt2", *flags]))


@pytest.mark.parametrize("flags, field, value", [
    (["--lora", "16"], "lora", "lora:16"),  # a rank alone: LoRA of that rank
    (["--lora", "QLoRA:64", "--precision", "bf16-mixed"], "lora", "qlora:64"),
    (["--lora"], "lora", "lora"),
    (["--lora", "lora:8"], "lora", "lora:8"),  # what it took before still reads the same
    (["--checkpointing"], "checkpointing", "blocks"),
    (["--checkpointing", "full"], "checkpointing", "blocks"),  # torchtitan's word
    (["--checkpointing", "true"], "checkpointing", "blocks"),  # transformers' gradient_checkpointing
    (["--checkpointing", "none"], "checkpointing", "off"),
    (["--checkpointing", "modules:MLP"], "checkpointing", "modules:MLP"),  # names keep their case
    (["--precision", "BF16_mixed"], "precision", "bf16-mixed"),
    (["--precision", "bf16-true"], "precision", "bf16"),  # Lightning's names
    (["--precision", "16-mixed"], "precision", "fp16-mixed"),
    (["--parallel", "FSDP"], "parallel", "fsdp"),
    (["--parallel", "fsdp2"], "parallel", "fsdp"),
    (["--attention", "SDPA"], "attention", "sdpa"),
    (["--parallel", "fsdp", "--offload", "cpu_unpinned"], "offload", "cpu-unpinned"),
    (["--compile", "true"], "compile", True),
    (["--compile", "Layers"], "compile", "layers"),
    (["--compile", "false"], "compile", False),
    (["--compile"], "compile", True),
    (["--lora", "8", "--lora-dtype", "bfloat16", "--precision", "bf16"], "lora_dtype", "bf16"),
    (["--parallel", "fsdp", "--mixed-precision", "bfloat16:float32"], "mixed_precision", "bf16:fp32"),
])
def test_the_spellings_people_type(flags, field, value):
    assert getattr(_recipe(*flags), field) == value


def test_lora_16_is_a_rank():
    recipe = _recipe("--lora", "16")
    assert recipe.lora == "lora:16" and _recipe("--lora", "lora:16") == recipe


@pytest.mark.parametrize("words, fix", [
    (["estimate", "gpt2", "--lora", "lora16"], "use off, lora, lora:16 or qlora:64"),
    (["estimate", "gpt2", "--lora", "0"], "a rank from 1"),
    (["estimate", "gpt2", "--seq-len", "2k"], "write the number, e.g. 2048"),
    (["estimate", "gpt2", "--compile", "maybe"], "is not one of true, false, layers"),
    (["estimate", "gpt2", "--parallel", "zero4"], "invalid choice"),
    (["estimate", "gpt2", "--offload-activations", "true"], "--no-flag for false"),
    (["serve-plan", "gpt2", "--context", "8k"], "write the number, e.g. 8192"),
])
def test_bad_input_is_one_line_naming_the_fix(words, fix, capsys):
    try:
        status = main(words)
    except SystemExit as exit:
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2 and fix in err and len(err.strip().splitlines()) == 1, err


def test_the_script_form_has_its_own_help(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["estimate", "--help", "train.py"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and "--rank N" in out and "SCRIPT.py" in out and "--lora" not in out
