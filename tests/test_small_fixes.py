"""Small things a new user hit (issue 33, item 6): a config's own dtype honoured by generate, a model config
of any file name, ``memfit plan --batch-size``, and memfit's own flags written after ``memfit profile``'s
script. Tiny configs only: every test here runs in well under a second once torch is imported."""

import json

import pytest
import transformers as tf

import memfit
from memfit.cli import _parser, main
from memfit.errors import MemfitError
from memfit.models.source import resolve

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
GEN = dict(prompt_len=4, new_tokens=2, device="cpu")


def _write(path, data: dict) -> str:
    path.write_text(json.dumps(data))
    return str(path)


# -- 1. generate honours the config's dtype --------------------------------------------------------------

@pytest.mark.parametrize("named, precision", [("float32", "fp32"), ("float16", "fp16"), ("bfloat16", "bf16")])
def test_generate_takes_the_dtype_an_older_config_json_names(tmp_path, named, precision):
    path = _write(tmp_path / "config.json", {**TINY, "torch_dtype": named})  # as transformers 4 wrote it
    report = memfit.estimate_generate(path, **GEN)
    assert (report.settings["precision"], report.settings["precision_from"]) == (precision, "config")
    assert f"precision {precision}: the config's dtype" in report.notes


def test_generate_takes_a_config_objects_dtype_and_a_given_precision_wins():
    config = tf.LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, dtype="float32")
    own = memfit.estimate_generate(config, **GEN)
    given = memfit.estimate_generate(config, precision="fp32", **GEN)
    assert own.settings["precision"] == "fp32" and own.peak_bytes == given.peak_bytes
    assert given.settings["precision_from"] == "given" and not any("precision" in n for n in given.notes)
    half = memfit.estimate_generate(config, precision="bf16", **GEN)
    assert half.settings["precision"] == "bf16" and half.peak_bytes < own.peak_bytes


def test_generate_defaults_to_bf16_only_where_the_config_names_no_dtype(tmp_path):
    report = memfit.estimate_generate(_write(tmp_path / "config.json", TINY), **GEN)
    assert (report.settings["precision"], report.settings["precision_from"]) == ("bf16", "default")
    assert "precision bf16: default, the config names none" in report.notes


def test_cli_generate_without_precision_uses_the_configs(tmp_path, capsys):
    path = _write(tmp_path / "config.json", {**TINY, "torch_dtype": "float32"})
    assert main(["estimate", path, "--generate", "--prompt-len", "4", "--new-tokens", "2", "--device", "cpu",
                 "--json"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["precision"], settings["precision_from"]) == ("fp32", "config")


# -- 2. a model config of any file name --------------------------------------------------------------------

@pytest.mark.parametrize("file", ["my-model.json", "llama_cfg.json", "llama_cfg"])
def test_a_config_of_any_file_name_is_that_file(tmp_path, file):
    # the folder's own config.json is another model: the file named is the one read
    _write(tmp_path / "config.json", {**TINY, "hidden_size": 128})
    source = resolve(_write(tmp_path / file, TINY))
    assert source.config.model_type == "llama" and source.config.hidden_size == 64
    assert source.name == file.removesuffix(".json") and source.task == "causal-lm"


def test_a_config_naming_only_its_architectures_is_read(tmp_path):
    data = {k: v for k, v in TINY.items() if k != "model_type"}
    source = resolve(_write(tmp_path / "arch.json", {**data, "architectures": ["LlamaForCausalLM"]}))
    assert source.config.model_type == "llama" and source.config.hidden_size == 64


def test_cli_estimates_a_config_with_no_json_suffix(tmp_path, capsys):
    path = _write(tmp_path / "llama_cfg", TINY)
    assert main(["estimate", path, "--generate", "--prompt-len", "4", "--new-tokens", "2", "--device", "cpu",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["workload"] == "generate"


def test_bad_config_files_are_one_line_naming_the_file_and_the_fix(tmp_path):
    bad = tmp_path / "my-model.json"
    bad.write_text('{"model_type": "llama",\n  "hidden_size": 64,,}')
    with pytest.raises(MemfitError) as err:
        resolve(str(bad))
    message = str(err.value)
    assert "\n" not in message and str(bad) in message and "not valid JSON" in message and "line 2" in message
    assert "fix the file" in message
    with pytest.raises(MemfitError, match="not a Hugging Face model config .*no model_type or architectures"):
        resolve(_write(tmp_path / "recipe.json", {"precision": "bf16-mixed"}))
    with pytest.raises(MemfitError, match="holds a JSON list, not a config object"):
        resolve(_write(tmp_path / "list.json", [TINY]))


# -- 3. memfit plan --batch-size ---------------------------------------------------------------------------

def test_plan_takes_batch_size_and_keeps_global_batch_size(monkeypatch, capsys):
    for flag in ("--batch-size", "--global-batch-size"):
        assert _parser().parse_args(["plan", "gpt2", flag, "4"]).global_batch_size == 4
    seen = {}

    def plan(model, batch, **kwargs):  # stands in for the planner: what the CLI passes is the test
        seen.update(kwargs)
        raise MemfitError("planned")

    monkeypatch.setattr("memfit.planner.plan.plan", plan)
    assert main(["plan", "gpt2", "--batch-size", "16", "--budget", "1GiB"]) == 2
    assert seen["data"].batch_size == 16  # the global batch, in the Data value the CLI builds (issue 50)
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--batch-size N, --global-batch-size N" in text and "--global-batch-size is the same flag" in text


# -- 4. memfit profile's own flags after the script --------------------------------------------------------

def _script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(f"import json, sys\njson.dump(sys.argv, open({str(tmp_path / 'argv.json')!r}, 'w'))\n")
    return script


def test_profile_warns_once_when_its_own_flags_follow_the_script(tmp_path, capsys):
    script = _script(tmp_path)
    assert main(["profile", "--device", "cpu", str(script), "--json", "--steps", "5", "--lr", "1"]) == 0
    assert json.loads((tmp_path / "argv.json").read_text()) == [str(script), "--json", "--steps", "5", "--lr", "1"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--json --steps after" in warnings[0] and "argv" in warnings[0]
    assert f"`memfit profile --json --steps 5 {script} ...`" in warnings[0]


def test_profile_is_silent_when_the_script_has_only_its_own_flags(tmp_path, capsys):
    script = _script(tmp_path)
    assert main(["profile", "--device", "cpu", "--json", str(script), "--lr", "1", "--", "--json"]) == 0
    assert json.loads((tmp_path / "argv.json").read_text()) == [str(script), "--lr", "1", "--", "--json"]
    assert "warning" not in capsys.readouterr().err
