"""A technique is one module: a toy one, written to a new file and registered at test time, is a
Recipe field, a CLI flag, a step in apply's order and an axis of the planner's search, with no
other file edited."""

import importlib.util
import json

import pytest
import torch
import transformers as tf

import memfit
from memfit import MemfitError, Recipe
from memfit.cli import main
from memfit.techniques.registry import field, registered, techniques

TOY = '''"""Toy technique: scale the loss by a constant (no memory effect; here to be registered)."""

from memfit.errors import MemfitError
from memfit.techniques.spec import Field, Technique

CALLS = []  # (recipe value, what the model/loss looked like when apply ran)


def _check(value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MemfitError(f"toy_scale must be a positive integer, got {value!r}")


def _apply(build):
    # runs after checkpointing (30) and before chunked_loss (40): no loss function replaced yet
    CALLS.append((build.recipe.toy_scale, build.loss_fn is None))
    scale, inner = build.recipe.toy_scale, build.loss_fn
    if scale != 1:
        def loss_fn(model, batch):
            loss = inner(model, batch) if inner is not None else model(**batch).loss
            return loss * scale
        build.loss_fn = loss_fn


def _conflicts(r):
    if r.toy_scale > 1 and r.optimizer_in_backward:
        yield "toy_scale and optimizer_in_backward conflict: the toy says so"


TECHNIQUE = Technique(
    name="toy", order=38, trace="graph", apply=_apply, conflicts=_conflicts,
    fields=(Field("toy_scale", 1, "multiply the loss by N (a toy)", slot=200, kind="count", check=_check),),
    search=lambda ctx: [{"toy_scale": 1}, {"toy_scale": 2}])
'''


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy_technique.py"
    path.write_text(TOY)
    spec = importlib.util.spec_from_file_location("toy_technique", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with registered(module.TECHNIQUE):
        yield module
    assert field("toy_scale") is None


def _config():
    return tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                          architectures=["LlamaForCausalLM"])


def test_a_toy_technique_is_a_recipe_field(toy, tmp_path):
    recipe = Recipe(toy_scale=3, precision="bf16-mixed")
    assert recipe.toy_scale == 3 and Recipe().toy_scale == 1
    assert recipe.to_dict()["toy_scale"] == 3 and "toy_scale=3" in recipe.describe()
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    recipe.save(str(tmp_path / "r.yaml"))
    assert Recipe.load(str(tmp_path / "r.yaml")) == recipe
    with pytest.raises(MemfitError, match="positive integer"):
        Recipe(toy_scale=0)
    with pytest.raises(MemfitError, match="toy_scale and optimizer_in_backward"):
        Recipe(toy_scale=2, optimizer_in_backward=True)


def test_a_toy_technique_runs_in_apply_order(toy):
    names = [t.name for t in techniques()]
    assert names.index("checkpointing") < names.index("toy") < names.index("chunked_loss")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_config())
    batch = {"input_ids": torch.randint(0, 512, (2, 16)), "labels": torch.randint(0, 512, (2, 16))}
    _, _, step = memfit.apply(model, Recipe(toy_scale=2, checkpointing="blocks", chunked_loss=2))
    loss = step(batch)
    assert toy.CALLS[-1] == (2, True)  # it ran before chunked_loss replaced the loss
    plain = memfit.apply(tf.LlamaForCausalLM(_config()), Recipe(toy_scale=2))[2]
    assert torch.isfinite(loss) and torch.isfinite(plain(batch))


def test_a_toy_technique_is_a_cli_flag(toy, tmp_path, capsys):
    config = tmp_path / "config.json"
    _config().to_json_file(str(config))
    assert main(["estimate", str(config), "--seq-len", "16", "--toy-scale", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["recipe"]["toy_scale"] == 2
    assert toy.CALLS[-1][0] == 2
    with pytest.raises(SystemExit):
        main(["estimate", str(config), "--help"])
    assert "--toy-scale" in capsys.readouterr().out


def test_a_toy_technique_is_searched_by_the_planner(toy):
    from memfit.planner.space import search_space

    class Engine:  # what the search reads
        target, depth, causal_lm, global_batch_size, has_blocks = None, 2, True, 2, True

    space = search_space(Engine, set(), "adamw")
    assert {r.toy_scale for r in space} == {1, 2}
    assert any(r.optimizer_in_backward for r in space)
    assert not [r for r in space if r.toy_scale == 2 and r.optimizer_in_backward]
    # planned: a small module and its batch on the CPU (its axes: precision x toy x micro-batch x in
    # backward, a few small traces; a config model's search traces 48 graphs for the toy's two values)
    from memfit.models.zoo import classify

    model = lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))  # noqa: E731
    batch = (torch.randn(4, 32), torch.randint(0, 10, (4,)))
    calls = len(toy.CALLS)
    plans = memfit.plan(model, batch, loss_fn=classify, device="cpu", budget="64MiB")
    assert {p.recipe.toy_scale for p in plans.front} | {p.recipe.toy_scale for p in plans} == {1, 2}
    assert "toy_scale" in plans.best.recipe.to_dict()
    assert {value for value, _ in toy.CALLS[calls:]} == {1, 2}  # each value traced: applied in the steps
