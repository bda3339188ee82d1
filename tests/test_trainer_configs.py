"""A trainer's own config file read into memfit's terms (issue 36, item 1): a Hugging Face TrainingArguments JSON, a
TRL SFT QLoRA YAML; each estimate equal to the same run said with memfit's flags; every setting memfit cannot model
refused in one line (exit 2 from the CLI), never dropped."""

from __future__ import annotations

import json
import re

import pytest

import memfit
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.trainers.read import read_trainer_config
from memfit.techniques.recipe import Recipe

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 256}

# a TrainingArguments file as people write them: fused AdamW, checkpointing, bf16, and settings that move no memory
TRAINER = {"output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": True,
           "optim": "adamw_torch_fused", "gradient_checkpointing": True,
           "gradient_checkpointing_kwargs": {"use_reentrant": False}, "learning_rate": 2e-5, "logging_steps": 10,
           "save_strategy": "steps", "report_to": "none", "lr_scheduler_type": "cosine", "warmup_steps": 100}

# TRL's SFT QLoRA recipe shape (trl/examples: SFTConfig and ModelConfig fields in one YAML)
TRL_QLORA = """\
model_name_or_path: meta-llama/Llama-3.2-1B
output_dir: out
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
max_length: 64
bf16: true
gradient_checkpointing: true
optim: paged_adamw_8bit
use_peft: true
load_in_4bit: true
lora_r: 16
lora_alpha: 32
lora_target_modules: all-linear
learning_rate: 2.0e-4
dataset_text_field: text
"""


@pytest.fixture(scope="module")
def llama(write_config):
    return write_config(LLAMA)


def _file(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_training_arguments_read_as_memfit_flags(tmp_path):
    config = read_trainer_config(_file(tmp_path, "args.json", TRAINER))
    assert config.kind == "hf-trainer"
    assert config.recipe == Recipe(precision="bf16-mixed", checkpointing="blocks", optimizer="adamw",
                                   optimizer_impl="fused", micro_batch_size=4, grad_accum_steps=2)
    assert config.batch_size(ranks=2) == 16
    assert dict((k, how) for k, _, how in config.read)["learning_rate"] == "no effect on a training step's device memory"


def test_the_trainers_defaults_are_the_trainers(tmp_path):
    """An empty TrainingArguments trains 8 rows a device with fused AdamW (transformers 5): not memfit's defaults."""
    config = read_trainer_config(_file(tmp_path, "args.yaml", "output_dir: out\n"))
    assert config.recipe.micro_batch_size == 8 and config.recipe.optimizer_impl == "fused"
    assert ("per_device_train_batch_size", 8, "the Trainer's default") in config.read


def test_trl_qlora_config(tmp_path):
    config = read_trainer_config(_file(tmp_path, "sft.yaml", TRL_QLORA))
    assert config.model == "meta-llama/Llama-3.2-1B" and config.seq_len == 64
    assert config.recipe == Recipe(precision="bf16-mixed", checkpointing="blocks", optimizer="paged_adamw8bit",
                                   micro_batch_size=2, grad_accum_steps=8, lora="qlora:16", lora_alpha=32,
                                   lora_dropout=0.05, lora_targets="all-linear")


def test_estimate_from_a_config_equals_the_same_flags(llama, tmp_path, capsys):
    path = _file(tmp_path, "args.json", TRAINER)
    assert main(["estimate", llama, "--from", path, "--seq-len", "32", "--device", "cpu", "--json"]) == 0
    read = json.loads(capsys.readouterr().out)
    flags = ["--precision", "bf16-mixed", "--checkpointing", "blocks", "--optimizer", "adamw_torch_fused",
             "--micro-batch-size", "4", "--grad-accum-steps", "2"]
    assert main(["estimate", llama, *flags, "--seq-len", "32", "--device", "cpu", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert read["peak_bytes"] == said["peak_bytes"] and read["phase_peaks"] == said["phase_peaks"]
    assert any(n.startswith("read args.json (hf-trainer): precision=bf16-mixed") for n in read["notes"])
    # flags still override the file
    assert main(["estimate", llama, "--from", path, "--micro-batch-size", "1", "--seq-len", "32", "--device", "cpu",
                 "--json"]) == 0
    smaller = json.loads(capsys.readouterr().out)
    assert smaller["peak_bytes"] < read["peak_bytes"]


@pytest.mark.parametrize("content, words", [
    ({"deepspeed": "ds_config.json"}, "deepspeed='ds_config.json': no such file here or beside args.json"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, "reentrant"),
    ({"per_device_train_batchsize": 4}, "'per_device_train_batchsize' is not a TrainingArguments"),
    ({"per_device_train_batch_size": 0}, "positive whole number"),
    ({"optim": "lomo"}, "optim='lomo' is a transformers optimizer memfit cannot model"),
    ({"bf16": True, "fp16": True}, "both true"),
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 1}}, "set version: 2"),
    ("max_length: 1024\noutput_dir: out\n", "defaults for gradient_checkpointing and bf16 differ"),
    ("use_peft: true\nbf16: true\ngradient_checkpointing: true\n", "lora_target_modules"),
    ("load_in_4bit: true\nbf16: true\ngradient_checkpointing: true\n", "set use_peft: true"),
    ("- a list\n", "must be a mapping"),
])
def test_what_memfit_cannot_model_is_one_line_exit_2(llama, tmp_path, capsys, content, words):
    path = _file(tmp_path, "args.yaml" if isinstance(content, str) else "args.json", content)
    with pytest.raises(MemfitError) as err:
        read_trainer_config(path)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert main(["estimate", llama, "--from", path, "--device", "cpu"]) == 2
    assert words in capsys.readouterr().err


def test_from_and_recipe_conflict(llama, tmp_path, capsys):
    path = _file(tmp_path, "args.json", TRAINER)
    recipe = _file(tmp_path, "recipe.yaml", "precision: bf16-mixed\n")
    assert main(["estimate", llama, "--from", path, "--recipe", recipe]) == 2
    assert "--from and --recipe" in capsys.readouterr().err


# what `accelerate config` writes for FSDP2 over 2 processes, with bf16 autocast and activation checkpointing
ACCELERATE_FSDP2 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_accelerate_fsdp2_config(llama, tmp_path, capsys):
    path = _file(tmp_path, "fsdp2.yaml", ACCELERATE_FSDP2)
    config = read_trainer_config(path)
    assert config.kind == "accelerate" and (config.gpus, config.nodes) == (2, 1)
    # accelerate sets FSDP2's policy from mixed_precision as well as wrapping the forward in autocast
    assert config.recipe == Recipe(parallel="fsdp", precision="bf16-mixed", mixed_precision="bf16",
                                   checkpointing="blocks", reshard_after_forward="true")
    assert main(["estimate", llama, "--from", path, "--batch-size", "4", "--seq-len", "32", "--device", "cpu",
                 "--json"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert main(["estimate", llama, "--parallel", "fsdp", "--precision", "bf16-mixed", "--mixed-precision", "bf16",
                 "--checkpointing", "blocks", "--gpus", "2", "--batch-size", "4", "--seq-len", "32", "--device", "cpu",
                 "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert read["world"]["gpus"] == 2 and [r["peak_bytes"] for r in read["ranks"]] == [r["peak_bytes"]
                                                                                       for r in said["ranks"]]


@pytest.mark.parametrize("change, words", [
    (("distributed_type: FSDP", "distributed_type: MEGATRON_LM"), "distributed_type='MEGATRON_LM' is not modelled"),
    (("fsdp_version: 2", "fsdp_version: 1"), "set fsdp_version: 2"),
    (("mixed_precision: bf16", "mixed_precision: fp8"), "mixed_precision='fp8' is not modelled"),
    (("num_processes: 2", "num_processes: 3\nnum_machines: 2"), "does not split over num_machines"),
    (("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", "fsdp_auto_wrap_policy: SIZE_BASED_WRAP"), "SIZE_BASED_WRAP"),
    (("debug: false", "debgu: false"), "'debgu' is not an accelerate config setting"),
])
def test_what_accelerate_sets_that_memfit_cannot_model_is_one_line(tmp_path, change, words):
    text = ACCELERATE_FSDP2.replace("num_machines: 1\n", "") if "num_machines: 2" in change[1] else ACCELERATE_FSDP2
    path = _file(tmp_path, "bad.yaml", text.replace(*change))
    with pytest.raises(MemfitError) as err:
        read_trainer_config(path)
    assert words in str(err.value) and "\n" not in str(err.value)


# the Trainer's own FSDP (transformers hands fsdp / fsdp_config to accelerate's FSDP2 plugin)
TRAINER_FSDP = """\
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
bf16: true
fsdp: full_shard auto_wrap
fsdp_config:
  version: 2
  reshard_after_forward: false
  activation_checkpointing: true
  transformer_layer_cls_to_wrap: [LlamaDecoderLayer]
  state_dict_type: SHARDED_STATE_DICT
"""


def test_trainer_fsdp_reads_as_fsdp2(llama, tmp_path, capsys):
    config = read_trainer_config(_file(tmp_path, "args.yaml", TRAINER_FSDP))
    assert config.recipe == Recipe(parallel="fsdp", precision="bf16-mixed", mixed_precision="bf16",
                                   reshard_after_forward="false", checkpointing="blocks", micro_batch_size=2,
                                   grad_accum_steps=2, optimizer_impl="fused")
    # full_shard in the legacy string and reshard_after_forward in fsdp_config: the config's word is transformers'
    # last (fsdp_config is read after the string)
    assert ("fsdp_config", None) not in [(k, v) for k, v, _ in config.read]
    assert main(["estimate", llama, "--from", _file(tmp_path, "a.yaml", TRAINER_FSDP), "--gpus", "2", "--seq-len",
                 "32", "--device", "cpu", "--json"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert main(["estimate", llama, "--parallel", "fsdp", "--precision", "bf16-mixed", "--mixed-precision", "bf16",
                 "--reshard-after-forward", "false", "--checkpointing", "blocks", "--micro-batch-size", "2",
                 "--grad-accum-steps", "2", "--optimizer-impl", "fused", "--gpus", "2", "--batch-size", "8",
                 "--seq-len", "32", "--device", "cpu", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert [r["peak_bytes"] for r in read["ranks"]] == [r["peak_bytes"] for r in said["ranks"]]


@pytest.mark.parametrize("text, words", [
    ("fsdp: hybrid_shard auto_wrap\n", "--shard-over node"),
    ("fsdp: true\nfsdp_config:\n  version: 1\n", "set version: 2"),
    ("fsdp: true\nfsdp_config:\n  limit_all_gathers: true\n", "'limit_all_gathers' is not an FSDP2 setting"),
    ("fsdp: true\nfsdp_config: fsdp.json\n", "a path to a JSON file is not read"),
    ("activation_checkpointing: true\nactivation_checkpointing_kwargs:\n  every_n_layers: 2\n", "every n-th layer"),
])
def test_trainer_fsdp_refusals(tmp_path, text, words):
    with pytest.raises(MemfitError, match=re.escape(words)):
        read_trainer_config(_file(tmp_path, "args.yaml", text))


def test_activation_checkpointing_is_transformers_new_name(tmp_path):
    config = read_trainer_config(_file(tmp_path, "args.yaml", "activation_checkpointing: true\n"))
    assert config.recipe.checkpointing == "blocks"
