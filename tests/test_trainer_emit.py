"""A plan written back in the user's trainer (issue 36, item 2): each emitted config accepted by that tool's own
parser (HfArgumentParser(TrainingArguments), accelerate's load_config_from_file and FullyShardedDataParallelPlugin,
Lightning's Trainer on the CPU), read back by memfit to the same recipe where the tool can say it, and to the same
estimate; what a tool cannot say is in the notes. Also LightningCLI configs read (``--from``)."""

from __future__ import annotations

import importlib
import json
import re

import pytest
import yaml

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.techniques.recipe import Recipe
from memfit.trainers.emit import TOOLS, emit
from memfit.trainers.read import read_trainer_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 256}

PLAIN = Recipe(precision="bf16-mixed", checkpointing="blocks", optimizer_impl="fused", micro_batch_size=2,
               grad_accum_steps=4)
FSDP2 = Recipe(parallel="fsdp", precision="bf16-mixed", mixed_precision="bf16", checkpointing="blocks",
               reshard_after_forward="false", optimizer_impl="fused", micro_batch_size=1, grad_accum_steps=2)
QLORA = Recipe(lora="qlora:8", lora_alpha=16, lora_targets="q_proj,v_proj", precision="bf16-mixed",
               checkpointing="blocks", micro_batch_size=2, optimizer="paged_adamw8bit")
CHUNKED = PLAIN.replace(chunked_loss=4)  # a field no trainer config has


@pytest.fixture(scope="module")
def llama(write_config):
    return write_config(LLAMA)


def _write(tmp_path, emitted) -> str:
    path = tmp_path / emitted.filename
    path.write_text(emitted.text)
    return str(path)


@pytest.mark.parametrize("recipe", [PLAIN, FSDP2, QLORA], ids=["plain", "fsdp2", "qlora"])
def test_hf_trainer_file_parses_and_reads_back_to_the_recipe(tmp_path, recipe):
    from transformers import HfArgumentParser, TrainingArguments

    emitted = emit(recipe, "hf-trainer", gpus=2, seq_len=64, model="qwen3-0.6b")
    data = yaml.safe_load(emitted.text)
    # the Trainer's own parser (use_cpu: its bf16 check asks for a GPU on this machine); TRL's fields are TRL's
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(data | {"output_dir": str(tmp_path), "use_cpu": True},
                                                             allow_extra_keys=recipe.lora != "off")
    assert args.per_device_train_batch_size == recipe.micro_batch_size
    assert args.gradient_accumulation_steps == recipe.grad_accum_steps
    assert args.bf16 is True
    assert bool(args.fsdp) == (recipe.parallel == "fsdp")
    back = read_trainer_config(_write(tmp_path, emitted))
    assert back.recipe == recipe
    if recipe.lora != "off":
        assert data["model_name_or_path"] == "Qwen/Qwen3-0.6B" and back.seq_len == 64
        assert any("TRL" in note for note in emitted.notes)
        import peft  # the LoRA fields are peft's LoraConfig's

        peft.LoraConfig(r=data["lora_r"], lora_alpha=data["lora_alpha"], lora_dropout=data["lora_dropout"],
                        target_modules=data["lora_target_modules"])
    assert any("torchrun --nproc-per-node 2" in note for note in emitted.notes)


def test_accelerate_file_parses_and_reads_back(tmp_path):
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.commands.config.config_args import load_config_from_file

    emitted = emit(FSDP2, "accelerate", gpus=4, nodes=2)
    path = _write(tmp_path, emitted)
    config = load_config_from_file(path)  # what `accelerate launch --config_file` reads
    assert (config.num_processes, config.num_machines, config.mixed_precision) == (8, 2, "bf16")
    fsdp = config.fsdp_config
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp["fsdp_version"], reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
        cpu_offload=fsdp["fsdp_offload_params"], activation_checkpointing=fsdp["fsdp_activation_checkpointing"],
        auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(), state_dict_type=fsdp["fsdp_state_dict_type"],
        mixed_precision_policy=config.mixed_precision)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False
    assert str(plugin.mixed_precision_policy.param_dtype) == "torch.bfloat16"  # what the reader models too
    back = read_trainer_config(path)
    assert (back.gpus, back.nodes) == (4, 2)
    # the batch and the optimizer are the script's: said in the notes, given to memfit with flags
    assert back.recipe.replace(micro_batch_size=1, grad_accum_steps=2, optimizer_impl="fused") == FSDP2
    assert any("Accelerator(gradient_accumulation_steps=2)" in note for note in emitted.notes)


def test_lightning_file_builds_a_trainer_and_reads_back(tmp_path):
    pytest.importorskip("lightning")
    import lightning.pytorch as L

    emitted = emit(FSDP2, "lightning", gpus=2)
    data = yaml.safe_load(emitted.text)
    trainer = dict(data["trainer"])
    strategy = trainer.pop("strategy")
    module, _, name = strategy["class_path"].rpartition(".")
    built = L.Trainer(**trainer | {"accelerator": "cpu",  # no GPU here: the rest as written
                                   "strategy": getattr(importlib.import_module(module), name)(**strategy["init_args"])})
    assert built.accumulate_grad_batches == 2 and type(built.strategy).__name__ == "ModelParallelStrategy"
    back = read_trainer_config(_write(tmp_path, emitted))
    # FSDP2's policy is the LightningModule's code (configure_model): the note says so, a flag gives it back
    assert back.recipe.replace(mixed_precision="bf16", reshard_after_forward="false", checkpointing="blocks") == FSDP2
    assert any("--mixed-precision bf16" in note for note in emitted.notes)


def test_pytorch_lines_rebuild_the_recipe():
    emitted = emit(CHUNKED, "pytorch")
    line = next(x for x in emitted.text.splitlines() if x.startswith("recipe = "))
    import memfit

    assert eval(line.split(" = ", 1)[1], {"memfit": memfit}) == CHUNKED  # noqa: S307 - our own emitted line


@pytest.mark.parametrize("tool", ["hf-trainer", "accelerate", "lightning"])
def test_what_a_tool_cannot_say_is_a_note(tool):
    emitted = emit(CHUNKED, tool)
    assert any(note.startswith("chunked_loss=4:") for note in emitted.notes)
    unpinned = emit(FSDP2.replace(offload="cpu-unpinned"), tool, gpus=2)
    assert any(note.startswith("offload=cpu-unpinned:") for note in unpinned.notes)


def test_emitted_estimate_equals_the_plan(llama, tmp_path, capsys):
    """Round trip through the CLI: `memfit estimate --from` the emitted TrainingArguments = the recipe's own estimate."""
    path = _write(tmp_path, emit(PLAIN, "hf-trainer"))
    args = ["--seq-len", "32", "--device", "cpu", "--json"]
    assert main(["estimate", llama, "--from", path, *args]) == 0
    read = json.loads(capsys.readouterr().out)
    recipe = tmp_path / "recipe.yaml"
    PLAIN.save(str(recipe))
    assert main(["estimate", llama, "--recipe", str(recipe), "--batch-size", "8", *args]) == 0
    said = json.loads(capsys.readouterr().out)
    assert read["peak_bytes"] == said["peak_bytes"]


def test_plan_emits_every_tool(llama, tmp_path, capsys):
    out = tmp_path / "emitted"
    assert main(["plan", llama, "--device", "cpu", "--budget", "1GiB", "--seq-len", "32", "--batch-size", "2",
                 "--emit", "all", "--emit-dir", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # all: every trainer's file; DeepSpeed's is a ZeRO recipe's, asked for by name (tests/test_deepspeed.py)
    assert [e["tool"] for e in result["emitted"]] == [t for t in TOOLS if t != "deepspeed"]
    best = Recipe(**result["best"]["recipe"]) if isinstance(result["best"]["recipe"], dict) else None
    back = read_trainer_config(str(out / "training_args.yaml"))
    if best is not None:
        assert back.recipe.micro_batch_size == best.micro_batch_size
    assert sorted(p.name for p in out.iterdir()) == sorted(e["filename"] for e in result["emitted"])


def test_plan_emit_bad_tool_is_one_line(llama, capsys):
    assert main(["plan", llama, "--device", "cpu", "--emit", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "--emit 'megatron' is not a tool memfit writes" in err and err.count("\n") == 1


# a LightningCLI config as people write one: the trainer, the data module's batch, the optimizer
LIGHTNING = """\
seed_everything: 0
trainer:
  accelerator: gpu
  devices: 2
  num_nodes: 1
  precision: bf16-mixed
  accumulate_grad_batches: 4
  strategy: ddp
  max_steps: 1000
  log_every_n_steps: 10
  gradient_clip_val: 1.0
model:
  class_path: my_project.LitLlama
data:
  class_path: my_project.TokensDataModule
  init_args:
    batch_size: 2
    num_workers: 4
optimizer:
  class_path: torch.optim.AdamW
  init_args:
    lr: 3.0e-4
    fused: true
"""


def test_a_lightning_cli_config_reads_as_its_flags(llama, tmp_path, capsys):
    path = tmp_path / "lightning.yaml"
    path.write_text(LIGHTNING)
    config = read_trainer_config(str(path))
    assert config.kind == "lightning" and (config.gpus, config.nodes) == (2, 1)
    assert config.recipe == Recipe(parallel="ddp", precision="bf16-mixed", grad_accum_steps=4, micro_batch_size=2,
                                   optimizer="adamw", optimizer_impl="fused")
    assert main(["estimate", llama, "--from", str(path), "--seq-len", "32", "--device", "cpu", "--json"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert main(["estimate", llama, "--parallel", "ddp", "--precision", "bf16-mixed", "--grad-accum-steps", "4",
                 "--micro-batch-size", "2", "--optimizer-impl", "fused", "--gpus", "2", "--batch-size", "16",
                 "--seq-len", "32", "--device", "cpu", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert [r["peak_bytes"] for r in read["ranks"]] == [r["peak_bytes"] for r in said["ranks"]]


@pytest.mark.parametrize("change, words", [
    (("strategy: ddp", "strategy: fsdp"), "FSDP1"),
    (("devices: 2", "devices: auto"), "pass --gpus N"),
    (("precision: bf16-mixed", "precision: 16-true"), "trainer.precision='16-true' is not modelled"),
    (("max_steps: 1000", "max_stepz: 1000"), "trainer.'max_stepz' is not an argument of Lightning's Trainer"),
    (("class_path: torch.optim.AdamW", "class_path: bitsandbytes.optim.AdamW8bit"), "pass --optimizer NAME"),
])
def test_what_lightning_sets_that_memfit_cannot_model_is_one_line(tmp_path, change, words):
    path = tmp_path / "lightning.yaml"
    path.write_text(LIGHTNING.replace(*change))
    with pytest.raises(MemfitError, match=re.escape(words)):
        read_trainer_config(str(path))


def test_the_model_comes_from_the_file_when_the_command_names_none(llama, tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text(f"model_name_or_path: {llama}\nmax_length: 32\nbf16: false\ngradient_checkpointing: false\n"
                    "per_device_train_batch_size: 2\n")
    assert main(["estimate", "--from", str(path), "--device", "cpu", "--json"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert main(["estimate", llama, "--from", str(path), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] == read["peak_bytes"]
    assert main(["estimate", "--device", "cpu"]) == 2
    assert "name the model" in capsys.readouterr().err
