"""``import memfit`` is quick and silent, ``memfit --help`` loads no torch, and the CLI's stderr
carries no third-party noise: only the listed lines are hidden, nothing else."""

import json
import logging
import subprocess
import sys
import warnings

import pytest
import transformers as tf

import memfit
from memfit.cli import _noise
from memfit.report.tables import front_around

HEAVY = "print(sorted(m for m in ('torch', 'transformers', 'rich', 'numpy') if m in sys.modules))"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_import_memfit_is_silent_and_loads_nothing_heavy():
    assert _python("import memfit").stdout == _python("import memfit").stderr == ""
    proc = _python(f"import memfit; import sys; {HEAVY}")
    assert proc.stdout.strip() == "[]" and proc.stderr == ""


def test_help_loads_nothing_heavy():
    proc = _python("import sys\nfrom memfit.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
                   f"    pass\n{HEAVY}")
    assert "estimate" in proc.stdout and proc.stdout.strip().endswith("[]"), proc.stdout + proc.stderr


def test_public_names_resolve_on_first_use():
    for name in memfit.__all__:
        assert getattr(memfit, name) is not None
        assert name in dir(memfit)
    # every workload's entry: training and forward (memfit.estimator), generate (memfit.generation)
    assert memfit.estimate.__module__ == "memfit.generation.workloads"
    assert memfit.estimate_generate.__module__ == "memfit.generation.generate"
    assert memfit.plan.__module__ == "memfit.planner.plan" and memfit.fit.__module__ == "memfit.planner.fit"
    assert callable(memfit.measure) and callable(memfit.apply)
    assert memfit.parse_size("1KiB") == 1024
    with pytest.raises(AttributeError):
        memfit.no_such_name  # noqa: B018


def test_quiet_hides_only_the_listed_lines():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _noise.quiet():
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("your own deprecation", FutureWarning)
            warnings.warn("fan_in_fan_out is set to False but the target module is `Conv1D`.", UserWarning)
            warnings.warn("`is_gradient_checkpointing` is deprecated", UserWarning)  # another category: shown
    assert [str(w.message) for w in seen] == ["your own deprecation", "`is_gradient_checkpointing` is deprecated"]
    shown = []
    handler = logging.Handler()
    handler.emit = shown.append
    bnb, hf = logging.getLogger("bitsandbytes.backends.cpu.ops"), logging.getLogger("transformers.modeling_utils")
    levels = [bnb.level, hf.level]
    for logger in (bnb, hf):  # on the loggers themselves: transformers' do not propagate to the root
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)  # conftest sets transformers' to errors only
    try:
        with _noise.quiet():
            bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module named 'kernels'")
            bnb.warning("something else from bitsandbytes")
            hf.warning("`loss_type=None` was set in the config but it is unrecognized. Using the default loss")
            hf.warning("`loss_type=ForMagicLoss` was set in the config but it is unrecognized.")
    finally:
        for logger, level in zip((bnb, hf), levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert [r.getMessage() for r in shown] == ["something else from bitsandbytes",
                                               "`loss_type=ForMagicLoss` was set in the config but it is unrecognized."]
    assert not logging.getLogger("bitsandbytes.backends.cpu.ops").filters  # removed after


def _llama(path):
    tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                   architectures=["LlamaForCausalLM"]).to_json_file(path)


def _gpt2(path):
    tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=256, bos_token_id=0, eos_token_id=0,
                  architectures=["GPT2LMHeadModel"]).to_json_file(path)


def _estimate_args(path, lora):
    return ["estimate", str(path), "--seq-len", "64", "--lora", lora, "--precision", "bf16-mixed", "--checkpointing",
            "blocks", "--gpu", "rtx-4090", "--json"]


def test_cli_estimate_with_qlora_and_checkpointing_has_a_clean_stderr(tmp_path):
    """A real process: its stderr from the first import on (bitsandbytes, peft, transformers as they load)."""
    path = tmp_path / "config.json"
    _llama(path)
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", *_estimate_args(path, "qlora")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["settings"]["recipe"]["lora"] == "qlora"
    assert proc.stderr == "", proc.stderr


def test_cli_estimate_with_lora_on_gpt2_warns_nothing(tmp_path, capfd):
    """GPT-2's Conv1D under LoRA (peft's fan_in_fan_out warning), in this process: no warning escapes
    memfit.cli.main and nothing reaches stderr (the process's own imports: the test above)."""
    from memfit.cli import main

    path = tmp_path / "config.json"
    _gpt2(path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()  # Python's default filters, as a process run by a user has them
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        code = main(_estimate_args(path, "lora"))
    out, err = capfd.readouterr()
    assert code == 0, err
    assert json.loads(out)["settings"]["recipe"]["lora"] == "lora"
    assert err == "" and [str(w.message) for w in seen] == []


def _point(name, nbytes):
    class P:
        recipe, device_bytes = name, nbytes
    return P()


def test_the_plan_table_shows_the_choice_and_its_neighbours():
    front = [_point(f"r{i}", 10 * i) for i in range(40)]
    rows, hidden = front_around(front, front[20])
    assert [p.recipe for p in rows] == [f"r{i}" for i in range(17, 24)] and hidden == 33
    rows, hidden = front_around(front, front[1])
    assert [p.recipe for p in rows] == ["r0", "r1", "r2", "r3", "r4"] and hidden == 35
    off = _point("checked", 205)  # the fully estimated choice, not a point of the predicted front
    rows, hidden = front_around(front, off)
    assert [p.recipe for p in rows] == ["r18", "r19", "r20", "checked", "r21", "r22", "r23"] and hidden == 34
    assert front_around(front[:3], front[1]) == (front[:3], 0)
