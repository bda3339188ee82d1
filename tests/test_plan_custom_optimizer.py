"""plan() with the user's own model, loss and optimizer (issue 27): every plan it returns fits its
budget by the CPU allocator's own count, more budget never gives a slower plan or a smaller
micro-batch, and the planner offers only what the estimate that checks it accepts: no
``optimizer_impl`` or 8-bit states for a callable optimizer, no stepping in backward where the
optimizer cannot, no technique or micro-batch the model refuses."""

import pytest
import torch
from torch import nn

import memfit
from memfit import MemfitError, Recipe
from memfit.estimator.truth import true_peak
from memfit.models.zoo import GPT, classify, gpt_batch, lm_loss
from memfit.planner.plan import CUSTOM_OPTIMIZER
from memfit.planner.space import search_space


def _model():
    return GPT(vocab=256, d=64, layers=2, heads=4, ctx=32)


BATCH = gpt_batch(batch=8, seq=32, vocab=256)


def _adamw(params):  # the user's own factory: memfit cannot name it, so cannot rebuild it fused
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _plan(budget, **kw):
    return memfit.plan(_model, BATCH, loss_fn=lm_loss, optimizer=kw.pop("optimizer", _adamw), device="cpu",
                       budget=budget, **kw)


class Wide(nn.Module):
    """A small MLP: plans in well under a second."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


WIDE_BATCH = (torch.randn(8, 64), torch.randint(0, 10, (8,)))


def _plan_wide(budget, optimizer=_adamw, **kw):
    return memfit.plan(Wide, WIDE_BATCH, loss_fn=classify, optimizer=optimizer, device="cpu", budget=budget, **kw)


def _sweep_cache():
    """One engine for a budget sweep of ``_plan``: the same model factory, batch and optimizer under each budget, so
    its traces and full estimates are made once, as a config model's ``EngineCache`` keeps them (that cache keeps no
    module model: a module or a batch could change between calls; in this sweep neither does)."""
    from memfit.planner.cache import EngineCache

    class Sweep(EngineCache):
        def key(self, source, batch, target, seq_len, loss_fn, optimizer, global_batch_size):
            return id(batch), target, seq_len, loss_fn, optimizer, global_batch_size

    return Sweep()


@pytest.fixture(scope="module")
def plain_peak():
    """The plain step's peak at the whole batch, by a full estimate: the budgets are fractions of it."""
    return memfit.estimate(_model, BATCH, loss_fn=lm_loss, optimizer=_adamw,
                           recipe=Recipe(micro_batch_size=8)).peak_bytes


def test_custom_optimizer_plans_fit_by_the_allocator_and_are_monotone(plain_peak):
    budgets = [int(plain_peak * f) for f in (0.6, 0.75, 1.1)]
    cache = _sweep_cache()
    sweep = [_plan(b, cache=cache) for b in budgets]
    assert len(cache) == 1
    for budget, plans in zip(budgets, sweep):
        for p in plans[:3]:  # the choice and the next two offered
            r = p.recipe
            # planned with what the user built: nothing that would rebuild the optimizer by name
            assert r.optimizer_impl == "auto" and r.optimizer == Recipe().optimizer and not r.offload_optimizer
            assert r.micro_batch_size * r.grad_accum_steps == 8
        best = plans.best
        assert best.verified and best.device_bytes <= budget
        assert CUSTOM_OPTIMIZER in best.reasons and plans.settings["optimizer"] == "custom:_adamw"
        # the CPU allocator's own count of real steps of the recipe, with the user's optimizer
        measured = true_peak(_model, BATCH, loss_fn=lm_loss, optimizer=_adamw, recipe=best.recipe)
        assert measured <= budget, (best.recipe.describe(), measured, budget)
        assert abs(measured - best.device_bytes) <= 64
    times = [plans.best.step_seconds for plans in sweep]
    micro = [plans.best.recipe.micro_batch_size for plans in sweep]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]  # the sweep spans different choices
    assert micro == sorted(micro)


def test_a_callable_is_never_rebuilt_by_name():
    """optimizer_impl (the issue's fused), 8-bit states and the optimizer's name: none is searched
    for a callable, even where allow names the 8-bit forms; the plan says they were left out."""

    class Engine:  # what the search reads
        target, depth, causal_lm, global_batch_size, has_blocks = None, 2, False, 4, True

    named = search_space(Engine, {"adamw8bit"}, "adamw")
    assert {r.optimizer_impl for r in named} == {"auto", "fused"} and "adamw8bit" in {r.optimizer for r in named}
    custom = search_space(Engine, {"adamw8bit"}, _adamw)
    assert {(r.optimizer, r.optimizer_impl) for r in custom} == {("adamw", "auto")}
    plans = _plan_wide("64MiB", allow="adamw8bit")
    assert all(p.recipe.optimizer_impl == "auto" and p.recipe.optimizer == "adamw" for p in list(plans) + plans.front)
    assert any("allow=adamw8bit left out" in n for n in plans.notes)
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, architectures=["LlamaForCausalLM"])
    with pytest.raises(MemfitError, match="optimizer by name"):  # per-rank estimates build it by name: one line
        memfit.plan(config, optimizer=_adamw, gpu="rtx-4090", gpus=2, global_batch_size=2, seq_len=16)


def _whole_model_only(params):
    """An optimizer that needs every parameter at once: stepping one parameter at a time
    (optimizer_in_backward) is refused."""
    params = list(params)
    if len(params) < 2:
        raise ValueError("this optimizer steps the whole model")
    return torch.optim.AdamW(params, lr=1e-3)


def test_stepping_in_backward_is_not_offered_where_its_trace_is_refused():
    budget = "2MiB"  # with an optimizer that steps one parameter at a time, in backward is the choice
    assert _plan_wide(budget).best.recipe.optimizer_in_backward
    plans = _plan_wide(budget, optimizer=_whole_model_only)
    assert not any(p.recipe.optimizer_in_backward for p in list(plans) + plans.front)
    assert any("optimizer_in_backward left out" in n and "whole model" in n for n in plans.notes)
    measured = true_peak(Wide, WIDE_BATCH, loss_fn=classify, optimizer=_whole_model_only, recipe=plans.best.recipe)
    assert measured <= plans.budget


class Convs(nn.Module):
    """No nn.Linear: LoRA finds nothing to adapt."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 10, 3)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x))).mean((2, 3))


class Normed(nn.Module):
    """BatchNorm1d refuses one row in training: micro-batch 1 is refused."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 10)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


def test_a_technique_the_model_refuses_is_left_out():
    batch = (torch.randn(4, 3, 12, 12), torch.randint(0, 10, (4,)))
    plans = memfit.plan(Convs, batch, loss_fn=classify, optimizer=_adamw, device="cpu", budget="64MiB",
                        allow="lora")
    assert all(p.recipe.lora == "off" for p in list(plans) + plans.front)
    assert any(n.startswith("lora=lora:16 left out") and "no linear layer" in n for n in plans.notes)
    with pytest.raises(MemfitError, match="no linear layer"):  # the estimate's own refusal, as before
        memfit.estimate(Convs, batch, loss_fn=classify, recipe=Recipe(lora="lora"))


@pytest.mark.parametrize("rows", [2, 8])
def test_a_micro_batch_the_model_refuses_is_left_out(rows):
    batch = (torch.randn(rows, 32), torch.randint(0, 10, (rows,)))
    plans = memfit.plan(Normed, batch, loss_fn=classify, optimizer=_adamw, device="cpu", budget="64MiB")
    assert all(p.recipe.micro_batch_size > 1 for p in list(plans) + plans.front)
    assert any("micro_batch_size=1 left out" in n for n in plans.notes)
    measured = true_peak(Normed, batch, loss_fn=classify, optimizer=_adamw, recipe=plans.best.recipe)
    assert measured <= plans.budget


def test_pure_bf16_of_a_float_batch_is_refused_and_not_planned():
    """A float32 batch into a model cast to bf16 fails in every real matmul (torch's meta kernels do not
    check): the estimate refuses it with the fix, and the planner leaves the bf16 candidates out."""
    with pytest.raises(MemfitError, match="same dtype.*casts the model, not the batch"):
        memfit.estimate(Wide, WIDE_BATCH, loss_fn=classify, recipe=Recipe(precision="bf16"))
    plans = _plan_wide("64MiB", allow="bf16")
    assert all(p.recipe.precision != "bf16" for p in list(plans) + plans.front)
    with pytest.raises(RuntimeError, match="same dtype"):  # the real step, as the estimate says
        Wide().to(torch.bfloat16)(WIDE_BATCH[0])
