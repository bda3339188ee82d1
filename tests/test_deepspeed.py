"""DeepSpeed ZeRO (issue 51): its settings by DeepSpeed's own names, what it cannot be combined with, the config it is
given (validated by DeepSpeed's own config class), and each rank's estimate against a real 2-rank DeepSpeed run on
gloo, graded by the CPU allocator's own events (``memfit.distributed.truth``)."""

import json

import pytest

import _truths

pytest.importorskip("deepspeed", reason="pip install 'memfit[deepspeed]'")

import memfit  # noqa: E402
from memfit import Recipe  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.techniques.deepspeed import zero_conflict  # noqa: E402
from memfit.techniques.zero_config import ZeroConfig, ds_config  # noqa: E402

# a tiny Llama whose sizes do not divide by 2 (DeepSpeed pads its partitions)
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 509, "hidden_size": 96,
          "intermediate_size": 257, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64}


def test_zero_settings_read_by_deepspeeds_names_keep_only_what_differs():
    zero = ZeroConfig.parse("reduce_bucket_size=5e7, overlap_comm=true, contiguous_gradients=true, "
                            "offload_optimizer=cpu")
    assert zero.text == "offload_optimizer=cpu,overlap_comm=true,reduce_bucket_size=50000000"  # the default dropped
    assert ZeroConfig.parse(zero.text) == zero and zero.get("sub_group_size") == 1_000_000_000
    section = {"stage": 3, "reduce_bucket_size": 50000000, "overlap_comm": True,
               "offload_optimizer": {"device": "cpu", "pin_memory": True}, "stage3_prefetch_bucket_size": 1000}
    read = ZeroConfig.from_ds(section, {"grad_accum_dtype": "fp32"})
    assert read.get("stage3_prefetch_bucket_size") == 1000 and read.get("grad_accum_dtype") == "fp32"
    assert read.zero_optimization(3)["offload_optimizer"] == {"device": "cpu"}


@pytest.mark.parametrize("text, fix", [
    ("reduce_bucket=5e7", "did you mean reduce_bucket_size"),
    ("zero_quantized_weights=true", "does not model this DeepSpeed setting yet"),
    ("offload_optimizer=nvme", "NVMe offload is not modelled yet"),
    ("reduce_bucket_size=lots", "not a whole number"),
    ("overlap_comm", "write key=value"),
])
def test_a_setting_memfit_does_not_model_is_refused_naming_it(text, fix):
    with pytest.raises(MemfitError, match=fix):
        ZeroConfig.parse(text)


def test_the_cli_refuses_a_bad_zero_setting_in_one_line(capsys):
    assert main(["estimate", "gpt2", "--parallel", "zero2", "--zero", "reduce_bucket=5e7"]) == 2
    err = capsys.readouterr().err
    assert "did you mean reduce_bucket_size" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("recipe, fix", [
    (dict(parallel="zero2", precision="bf16-mixed"), "DeepSpeed casts the model itself"),
    (dict(parallel="zero2", zero="offload_param=cpu"), "offload_param=cpu needs parallel=zero3"),
    (dict(parallel="zero3", offload="cpu"), "DeepSpeed's own: zero offload_optimizer=cpu"),
    (dict(parallel="fsdp", zero="overlap_comm=true"), "needs parallel=zero1, zero2 or zero3"),
    (dict(parallel="zero2", zero="offload_optimizer_pin_memory=false"), "needs offload_optimizer=cpu"),
    (dict(parallel="zero2", lora="qlora:8", precision="bf16", quant_impl="torchao"), "use quant_impl=bnb"),
])
def test_what_zero_cannot_be_combined_with_is_one_line(recipe, fix):
    assert fix in zero_conflict(_unchecked(recipe))


def test_qlora_under_zero3_partitions_the_4bit_codes_packed_as_bf16(tmp_path):
    """ZeRO-3 partitions every weight: bitsandbytes' codes are packed as bf16 (transformers' bnb_4bit_quant_storage),
    the same bytes, split over the ranks; under ZeRO-2 each rank holds the whole 4-bit base."""
    from memfit.techniques.lora import prepare_lora

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    common = dict(batch_size=2, seq_len=32, gpus=2, device="cpu")
    reports = {stage: memfit.estimate(str(path), recipe=Recipe(parallel=stage, precision="bf16", lora="qlora:8"),
                                      **common) for stage in ("zero2", "zero3")}
    assert reports["zero3"].by_category["parameters"] < 0.75 * reports["zero2"].by_category["parameters"]
    import torch
    import transformers as tf

    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"}))
    prepare_lora(model, Recipe(parallel="zero3", precision="bf16", lora="qlora:8"))
    four_bit = [m.weight for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert four_bit and all(w.dtype == torch.bfloat16 and w.quant_storage == torch.bfloat16 for w in four_bit)


def _unchecked(values):
    """A Recipe's values without its own checks (they would raise the same conflict first)."""
    base = Recipe().to_dict()
    return type("R", (), {**base, **values})()


def test_the_config_it_writes_is_deepspeeds_own_valid_config():
    from deepspeed.runtime.config import DeepSpeedConfig

    recipe = Recipe(parallel="zero3", precision="bf16", grad_accum_steps=2,
                    zero="offload_optimizer=cpu,stage3_prefetch_bucket_size=1e6,grad_accum_dtype=fp32,"
                         "offload_optimizer_pin_memory=false")
    config = ds_config(recipe, world_size=1, micro_batch_size=4)
    checked = DeepSpeedConfig(json.loads(json.dumps(config)))
    assert checked.zero_optimization_stage == 3 and checked.bfloat16_config.enabled
    assert checked.grad_accum_dtype == "fp32"
    assert checked.zero_config.offload_optimizer.device == "cpu"
    assert checked.zero_config.offload_optimizer.pin_memory is False
    assert ZeroConfig.from_ds(config["zero_optimization"], config.get("data_types")) == ZeroConfig.parse(recipe.zero)
    assert checked.zero_config.prefetch_bucket_size == 1_000_000
    assert checked.gradient_accumulation_steps == 2 and checked.train_batch_size == 8


# 2 ranks, in the session's one torchrun with the other modules' truths (tests/_truths.py), after them
TRUTH_RECIPES = [dict(parallel="zero2", precision="bf16", attention="eager", grad_accum_steps=2,
                      zero="reduce_bucket_size=50000,overlap_comm=true"),
                 dict(parallel="zero3", precision="bf16", attention="eager",
                      zero="reduce_bucket_size=50000,stage3_prefetch_bucket_size=50000,"
                           "stage3_param_persistence_threshold=1000")]
TRUTH_SHAPE = dict(batch_size=16, seq_len=32, steps=4)
_truths.register("deepspeed", [(CONFIG, {"recipe": r, **TRUTH_SHAPE}) for r in TRUTH_RECIPES], last=True)


def test_each_rank_is_a_real_deepspeed_runs_peak(tmp_path, tmp_path_factory):
    """Stage 2 with accumulation and overlapped buckets, stage 3 with small prefetch and persistence: DeepSpeed 0.19.8's
    engine on gloo, 2 ranks, 4 steps (stage 3 reaches its steady trace from step 3), each rank's peak from its own
    allocator events, against memfit's estimate of that rank (DeepSpeed's engine on fake tensors)."""
    import memfit

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    truths = _truths.results(tmp_path_factory, "deepspeed")
    for recipe, ranks in zip(TRUTH_RECIPES, truths):
        estimate = memfit.estimate(str(path), recipe=Recipe(**recipe), gpus=2, device="cpu", **TRUTH_SHAPE)
        estimated = {r["rank"]: r["peak_bytes"] for r in estimate.ranks}
        errors = [abs(estimated.get(rank["rank"], estimated[0]) - rank["peak_bytes"]) / rank["peak_bytes"]
                  for rank in ranks]  # rank 0, and the last of stage 2 (its partition holds the padding)
        # issue 51's bar: every rank within 2 %, and one rank of each case to 0.01 %, which a wrong model of any of
        # DeepSpeed's buffers would miss. Both ranks agree to 16 bytes in 40 of 40 loaded runs since the truth waits
        # for gloo's future to let go of a bucket (``truth._busy``); before, 1 run in 5 had one rank a bucket high
        # (68 to 236 KB), its free made on gloo's thread where the profiler records none
        assert max(errors) <= 0.02 and min(errors) <= 0.0001, (recipe, ranks, estimated)


DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "bf16": {"enabled": "auto"},
             "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                                   "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                                   "offload_optimizer": {"device": "cpu", "pin_memory": True}},
             "gradient_clipping": "auto", "steps_per_print": 100}


def test_a_ds_config_with_the_trainers_auto_values_reads_as_zero(tmp_path, capsys):
    """A ds_config.json on its own, the Trainer's ``deepspeed`` key naming it, and accelerate's DeepSpeed plugin; the
    ``auto`` buckets resolved as the Trainer resolves them (hidden², 0.9 hidden², 10 hidden) when the engine is made:
    the estimate from the file is the estimate from the flags with those numbers."""
    from memfit.trainers.read import read_trainer_config

    (tmp_path / "ds.json").write_text(json.dumps(DS_CONFIG))
    alone = read_trainer_config(tmp_path / "ds.json")
    assert alone.kind == "deepspeed" and alone.recipe.parallel == "zero3"
    assert ZeroConfig.parse(alone.recipe.zero).get("reduce_bucket_size") == "auto"
    (tmp_path / "args.json").write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                                    "bf16": True, "deepspeed": "ds.json"}))
    trainer = read_trainer_config(tmp_path / "args.json").recipe
    assert (trainer.parallel, trainer.precision, trainer.micro_batch_size, trainer.grad_accum_steps) == \
        ("zero3", "bf16", 4, 2)  # the Trainer's bf16 is DeepSpeed's bf16 section: the engine casts the model
    (tmp_path / "accelerate.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: bf16\n"
                                              "deepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: cpu\n")
    plugin = read_trainer_config(tmp_path / "accelerate.yaml")
    assert (plugin.recipe.parallel, plugin.recipe.zero, plugin.gpus) == ("zero2", "offload_optimizer=cpu", 2)

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    shape = ["--batch-size", "16", "--seq-len", "32", "--gpus", "2", "--device", "cpu", "--attention", "eager",
             "--json"]
    assert main(["estimate", str(config), "--from", str(tmp_path / "args.json"), *shape]) == 0
    read = json.loads(capsys.readouterr().out)
    hidden = CONFIG["hidden_size"]
    zero = (f"overlap_comm=true,offload_optimizer=cpu,reduce_bucket_size={hidden ** 2},"
            f"stage3_prefetch_bucket_size={int(0.9 * hidden ** 2)},stage3_param_persistence_threshold={10 * hidden}")
    # the Trainer's default optim is adamw_torch_fused
    assert main(["estimate", str(config), "--parallel", "zero3", "--precision", "bf16", "--micro-batch-size", "4",
                 "--grad-accum-steps", "2", "--optimizer-impl", "fused", "--zero", zero, *shape]) == 0
    said = json.loads(capsys.readouterr().out)
    assert read["peak_bytes"] == said["peak_bytes"] and read["phase_peaks"] == said["phase_peaks"]


@pytest.mark.parametrize("change, words", [
    ({"zero_optimization": {"stage": 0}}, "memfit models ZeRO stages 1, 2 and 3"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing is not modelled"),
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}}, "does not model this DeepSpeed setting"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer type 'lamb' is not modelled"),
    ({"zero_optimisation": {"stage": 2}}, "'zero_optimisation' is not a DeepSpeed setting memfit knows"),
])
def test_a_ds_config_memfit_cannot_model_is_one_line(tmp_path, change, words):
    from memfit.trainers.read import read_trainer_config

    (tmp_path / "ds.json").write_text(json.dumps({**DS_CONFIG, **change}))
    with pytest.raises(MemfitError) as err:
        read_trainer_config(tmp_path / "ds.json")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_emit_deepspeed_writes_a_config_deepspeed_accepts_and_memfit_reads_back(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    from memfit.trainers.emit import emit
    from memfit.trainers.read import read_trainer_config

    recipe = Recipe(parallel="zero3", precision="bf16", micro_batch_size=4, grad_accum_steps=2, checkpointing="blocks",
                    zero="overlap_comm=true,offload_optimizer=cpu,stage3_max_live_parameters=1e8")
    emitted = emit(recipe, "deepspeed", gpus=8)
    assert emitted.filename == "ds_config.json" and json.loads(emitted.text)["train_batch_size"] == 4 * 2 * 8
    # DeepSpeed's own validation (it raises on a bad config), at the world size of this process (no process group: 1)
    DeepSpeedConfig(json.loads(emit(recipe, "deepspeed", gpus=1).text))
    assert any(n.startswith("checkpointing=blocks: deepspeed has no setting") for n in emitted.notes)
    (tmp_path / "ds_config.json").write_text(emitted.text)
    back = read_trainer_config(tmp_path / "ds_config.json").recipe
    assert (back.parallel, back.zero, back.precision, back.micro_batch_size, back.grad_accum_steps) == \
        (recipe.parallel, recipe.zero, recipe.precision, recipe.micro_batch_size, recipe.grad_accum_steps)
    with pytest.raises(MemfitError, match="plan with --parallel zero1, zero2 or zero3"):
        emit(Recipe(parallel="fsdp"), "deepspeed", gpus=8)


def test_memfit_train_refuses_a_zero_recipe_in_one_line(capsys):
    """memfit's trainer runs FSDP2 and DDP; a ZeRO recipe is estimated, not trained by it: one line, the way out named."""
    import torch

    from memfit.training.loop import train

    with pytest.raises(MemfitError, match="does not run parallel=zero2.*--emit deepspeed"):
        train(torch.nn.Linear(4, 4), [torch.zeros(4)], recipe=Recipe(parallel="zero2"))
    assert main(["train", "gpt2", "--parallel", "zero3", "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert "does not run parallel=zero3" in err and len(err.strip().splitlines()) == 1, err


def test_buckets_gradient_partitions_and_gathers_have_their_roles(tmp_path):
    """DeepSpeed's buffers by role, not as temporaries: stage 2's reduction buckets (two with overlap_comm, made at
    each backward) are communication of reduce_bucket_size 16-bit elements each, its gradient partition gradients;
    stage 3's gathered parameters unsharded parameters. The roles move bytes between categories, never the peak."""
    from memfit.categories import Category
    from memfit.estimator.fake_trace import fake_trace
    from memfit.hardware.cluster import World, fake_world
    from memfit.models.source import resolve
    from memfit.techniques.deepspeed import torch_as_found

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    recipes = {"zero2": Recipe(parallel="zero2", precision="bf16", attention="eager",
                               zero="reduce_bucket_size=50000,overlap_comm=true"),
               "zero3": Recipe(parallel="zero3", precision="bf16", attention="eager", zero="reduce_bucket_size=50000")}
    found = {}
    for name, recipe in recipes.items():
        with fake_world(World(2), 0), torch_as_found():
            report, result = fake_trace(resolve(str(path)), None, recipe=recipe, loss_fn=None, optimizer=None, steps=2,
                                        batch_size=2, seq_len=32, keep=True)
        found[name] = {c: [r.nbytes for r in result.ledger.records if r.category is c] for c in Category}
        assert sum(report.by_category.values()) == report.peak_bytes
    assert found["zero2"][Category.COMMUNICATION] == [50_000 * 2] * 4  # two buckets, each step's backward
    assert found["zero2"][Category.GRADIENTS] and not found["zero2"][Category.UNSHARDED_PARAMETERS]
    assert found["zero3"][Category.UNSHARDED_PARAMETERS] and found["zero3"][Category.GRADIENTS]


@pytest.mark.parametrize("stage, zero", [("zero2", "offload_optimizer=cpu"),
                                         ("zero3", "offload_optimizer=cpu,offload_param=cpu")])
def test_zero_offload_for_a_card_puts_the_offloaded_partitions_on_the_host(tmp_path, stage, zero):
    """Under CUDA semantics ZeRO-Offload's host partitions (found by DeepSpeed's attribute names) and the client
    optimizer's step are the host's: no optimizer state on the GPU, at least the fp32 master partition and AdamW's
    two states of this rank's share on the host; under CPU semantics nothing is split."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    common = dict(batch_size=2, seq_len=32, gpus=2)
    recipe = Recipe(parallel=stage, precision="bf16", attention="eager", zero=f"reduce_bucket_size=50000,{zero}")
    card = memfit.estimate(str(path), recipe=recipe, gpu="h100-sxm", **common)
    kept = memfit.estimate(str(path), recipe=recipe.replace(zero="reduce_bucket_size=50000"), gpu="h100-sxm", **common)
    params = card.parameters
    assert card.by_category["optimizer_state"] == 0 < kept.by_category["optimizer_state"]
    assert card.host_bytes >= 12 * params // 2  # fp32 master, exp_avg, exp_avg_sq of half the parameters
    assert card.peak_bytes < kept.peak_bytes
    assert any("ZeRO-Offload" in note for note in card.notes)
    # DeepSpeed 0.19.8 pins by default: the fp32 master partition and its gradient at least, in power-of-two blocks
    assert 8 * params // 2 <= card.pinned_bytes <= card.host_bytes
    unpinned = memfit.estimate(str(path), recipe=recipe.replace(zero=recipe.zero + "," + ",".join(
        f"{key}_pin_memory=false" for key in ("offload_optimizer", "offload_param") if key in zero)),
        gpu="h100-sxm", **common)
    assert unpinned.peak_bytes == card.peak_bytes  # pinning moves no device byte
    assert unpinned.host_bytes < card.host_bytes  # nor rounds host blocks up to powers of two
    if stage == "zero2":
        assert unpinned.pinned_bytes == 0
    else:  # stage 3 pins its flat 16-bit host buffer whatever the sections say (stage3.py:906)
        flat = 2 * (params // 2)
        assert 0 < unpinned.pinned_bytes <= 2 * flat + 64
    cpu = memfit.estimate(str(path), recipe=recipe, device="cpu", **common)
    assert cpu.host_bytes is None
