"""Every recipe the planner can produce trains under ``train()`` with its LR schedule (issue 34 item 1).

The space is the planner's own (``planner.space``: each technique's ``search`` under a GPU context,
every approximation allowed), walked one axis at a time from a base, plus every optimizer x
implementation x wrapper (in-backward, offloaded, the safe step train adds) with checkpointing and
chunked loss, where the KeyError of LambdaLR on a per-parameter optimizer was. CUDA's defaults are
forced where a CPU runs them: ``optimizer_impl`` foreach or fused instead of auto, and the safe step
``memfit train`` uses. Each recipe takes two optimizer steps with warmup; the learning rate each
step used is in the metrics and must follow the schedule, and the weights must move.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from memfit import Recipe
from memfit.errors import MemfitError
from memfit.hardware.gpus import gpu
from memfit.techniques.registry import techniques
from memfit.techniques.spec import SearchContext
from memfit.training.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ranks_worker as worker  # noqa: E402

LR = 1e-3
BASE = dict(micro_batch_size=2, grad_accum_steps=2)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _axes() -> dict[str, list[dict]]:
    """Each searched technique's candidate values, as ``plan`` asks for them on an H100 with every
    approximation allowed."""
    from memfit.planner.space import allowable

    ctx = SearchContext(gpu=gpu("h100-sxm"), allowed=frozenset(allowable()), optimizer="adamw",
                        global_batch_size=4, depth=2, has_blocks=True, causal_lm=True)
    return {t.name: list(t.search(ctx)) for t in techniques() if t.search is not None}


def _one_axis() -> list[Recipe]:
    out = []
    for name, values in _axes().items():
        for value in values:
            fields = {**BASE, **value}
            if fields.get("optimizer_in_backward"):
                fields["grad_accum_steps"] = 1
            if "micro_batch_size" in value:  # accumulation's axis: its own split of the batch of 4
                fields["grad_accum_steps"] = 4 // value["micro_batch_size"]
            try:
                out.append(Recipe(**fields))
            except MemfitError:
                continue
    return out


def _optimizer_grid() -> list[Recipe]:
    out = []
    for optimizer in ("adamw", "sgd", "adafactor", "adamw8bit"):
        for impl in ("auto", "foreach", "fused"):
            for wrapper in ({}, {"optimizer_in_backward": True, "grad_accum_steps": 1}, {"offload_optimizer": True},
                            {"safe_step": 4}):
                fields = {**BASE, "optimizer": optimizer, "optimizer_impl": impl, "precision": "bf16-mixed",
                          "checkpointing": "blocks", "chunked_loss": 2, **wrapper}
                try:
                    out.append(Recipe(**fields))
                except MemfitError:  # a combination Recipe refuses is not one the planner produces
                    continue
    return out


def _runnable(recipe: Recipe) -> str | None:
    """Why this CPU cannot run ``recipe`` (None: it can)."""
    if ("8bit" in recipe.optimizer or recipe.lora.startswith("qlora")) and not _has("bitsandbytes"):
        return "bitsandbytes is not installed"
    if recipe.offload_optimizer:
        return "torchao's CPUOffloadOptimizer needs a CUDA or XPU device (bench/training/train_gpu.py runs it on a GPU)"
    if recipe.offload_activations:
        return "activation offload moves saved tensors to pinned host memory on a CUDA stream"
    return None


RECIPES = list(dict.fromkeys(_one_axis() + _optimizer_grid()))


def _id(recipe: Recipe) -> str:
    return recipe.describe().replace(" ", "") or "default"


@pytest.mark.parametrize("recipe", RECIPES, ids=[_id(r) for r in RECIPES])
def test_every_planned_recipe_trains_with_the_schedule(tmp_path, recipe):
    why = _runnable(recipe)
    if why:
        pytest.skip(why)
    model = worker.model()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        result = train(model, worker.Tokens(16), recipe=recipe, global_batch_size=4, steps=2, lr=LR, warmup=2,
                       schedule="cosine", out_dir=tmp_path, progress=False, seed=1, seq_len=64)
    except (RuntimeError, NotImplementedError) as err:
        if "bitsandbytes" in str(err) or "CUDA" in str(err):  # bnb's CPU build lacks this kernel
            pytest.skip(f"this CPU build cannot run it: {str(err)[:120]}")
        raise
    assert result.steps == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    # warmup of 2 steps: the first step at half the rate, the second at the full one
    assert [line["lr"] for line in lines] == pytest.approx([LR / 2, LR]), lines
    moved = [not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters())]
    assert any(moved), "no weight moved"


def test_the_grid_covers_the_wrappers_and_implementations():
    seen = {(r.optimizer, r.optimizer_impl, r.optimizer_in_backward, r.offload_optimizer, r.safe_step) for r in RECIPES}
    assert ("adamw", "fused", True, False, None) in seen  # the recipe of the KeyError on the H200
    assert ("adamw", "auto", False, True, None) in seen
    assert ("sgd", "fused", False, False, 4) in seen
    names = {r.optimizer for r in RECIPES}
    assert {"adamw", "sgd", "adafactor", "adamw8bit", "paged_adamw8bit"} <= names
    assert len(RECIPES) >= 30
