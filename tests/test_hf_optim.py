"""transformers' ``optim=`` names: each maps to the optimizer the Trainer itself builds (graded by
``Trainer.get_optimizer_cls_and_kwargs``, not by memfit's table), the names are accepted wherever a
recipe takes an optimizer, and a name memfit cannot model is one line."""

import importlib.util

import pytest
import torch
import transformers as tf

from memfit import MemfitError, Recipe
from memfit.cli import main
from memfit.techniques.optimizer import HF_OPTIM, hf_optim, make_optimizer

# skipped without them, found without importing them: each pytest worker collects every module, and importing
# bitsandbytes and torchao costs a worker that runs none of these tests ~5 s
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("bitsandbytes", "torchao")),
                                reason="needs bitsandbytes and torchao: pip install -e '.[dev]'")


def _trainer_optimizer(name, params):
    args = tf.TrainingArguments(output_dir="/tmp/memfit-hf-optim", optim=name, report_to=[], use_cpu=True)
    cls, kwargs = tf.Trainer.get_optimizer_cls_and_kwargs(args)
    return cls(params, **{k: v for k, v in kwargs.items() if k != "params"})


def _settings(opt):
    """What decides the memory of an optimizer: its class (torchao's, under memfit's fake-step
    mixin), the implementation flags, the 8/4-bit block size and bits, SGD momentum."""
    group = opt.param_groups[0]
    base = next(c for c in type(opt).__mro__ if not c.__module__.startswith("memfit"))
    if hasattr(opt, "optimizer_name"):  # bitsandbytes: AdamW8bit is AdamW(optim_bits=8); the args decide
        base = (opt.optimizer_name, tuple(sorted(vars(opt.args).items())))
    keys = ("foreach", "fused", "momentum", "optim_bits", "is_paged", "scale_parameter", "relative_step", "beta1")
    return (base, getattr(opt, "block_size", None), getattr(opt, "is_paged", None),
            {k: group[k] for k in keys if k in group})


@pytest.mark.parametrize("name", list(HF_OPTIM))
def test_each_name_builds_what_the_trainer_builds(name):
    fields = hf_optim(name)
    recipe = Recipe(**fields)
    params = [torch.nn.Parameter(torch.zeros(64, 64))]
    ours = make_optimizer(recipe.optimizer, params, recipe.optimizer_impl)
    theirs = _trainer_optimizer(name, [torch.nn.Parameter(torch.zeros(64, 64))])
    assert _settings(ours) == _settings(theirs)


def test_names_are_accepted_where_an_optimizer_is_typed(tmp_path, capsys):
    assert Recipe(optimizer="adamw_torch_fused") == Recipe(optimizer="adamw", optimizer_impl="fused")
    assert Recipe(optimizer="adamw_torch_4bit").optimizer == "hf_adamw4bit"
    path = tmp_path / "r.yaml"
    path.write_text("optimizer: paged_adamw_8bit\n")
    assert Recipe.load(str(path)).optimizer == "paged_adamw8bit"
    # memfit's own names win where both exist: sgd (momentum 0.9) and adafactor (torch's)
    assert Recipe(optimizer="sgd").optimizer == "sgd" and hf_optim("sgd") == {"optimizer": "hf_sgd"}
    assert main(["estimate", "gpt2", "--seq-len", "32", "--optimizer", "adamw_torch_fused", "--json"]) == 0
    assert '"optimizer_impl": "fused"' in capsys.readouterr().out


def test_unmodelled_names_are_one_line():
    with pytest.raises(MemfitError, match="lion_8bit' is a transformers optimizer memfit cannot model"):
        hf_optim("lion_8bit")
    with pytest.raises(MemfitError, match="not a transformers optimizer name"):
        hf_optim("adamw_typo")
    with pytest.raises(MemfitError, match="adamw_torch_fused and optimizer_impl=forloop conflict"):
        Recipe(optimizer="adamw_torch_fused", optimizer_impl="forloop")


@pytest.mark.parametrize("optimizer", ["hf_sgd", "hf_adafactor"])
def test_trainer_forms_match_the_allocator(optimizer):
    import memfit
    from memfit.estimator.truth import true_peak
    from memfit.models.zoo import CASES

    factory, make_batch, loss_fn = CASES["gpt"]
    recipe = Recipe(optimizer=optimizer)
    estimated = memfit.estimate(factory, make_batch(), loss_fn=loss_fn, recipe=recipe).peak_bytes
    measured = true_peak(factory, make_batch(), loss_fn=loss_fn, recipe=recipe)
    assert abs(estimated - measured) <= 16, (estimated, measured)
