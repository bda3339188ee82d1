"""fit(): the largest micro-batch that fits, checked by full estimates on both sides of the answer,
against the CPU allocator, and through the CLI (``memfit fit``, ``estimate --max-batch-size``);
plan for custom modules (``--batch``/``--loss``) and for models without repeated blocks."""

import json

import pytest
import torch
import transformers as tf

from memfit import Fit, MemfitError, NoBatchFits, Recipe, estimate, fit, plan
from memfit.cli import main
from memfit.estimator.estimate import resolve_target
from memfit.models.zoo import GPT, MLP, classify, gpt_batch, lm_loss
from memfit.estimator.truth import true_peak
from memfit.planner.cache import EngineCache

GPU = "rtx-4090"
MIB = 2**20
ZOO = "memfit.models.zoo"
CACHE = EngineCache()  # the fits of _config() share their traces


def _config():
    return tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                          architectures=["LlamaForCausalLM"])


def _context():
    return resolve_target("cuda", GPU).outside_bytes


def _gpt():
    return GPT(vocab=512, d=64, layers=2, heads=4, ctx=64)


def _edges(found: Fit, full) -> None:
    """The answer fits by a full estimate, the next size up does not, and fit reports both."""
    at, above = full(found.micro_batch_size, found.budget_bytes), full(found.micro_batch_size + 1, found.budget_bytes)
    assert at.device_bytes == found.device_bytes <= found.budget_bytes and at.verdict == "fits"
    # one size up, torch's default allocator runs out under the budget: the figure is what it held
    # plus what it lacked (under a memory fraction a 20 MiB segment can be refused below the budget)
    assert above.verdict != "fits"
    assert above.device_bytes + (above.missing_bytes or 0) == found.next_bytes >= found.device_bytes
    assert found.estimates >= 2


def test_fit_on_a_config_answers_the_edge_and_keeps_accumulation():
    recipe = Recipe(precision="bf16-mixed", grad_accum_steps=2)
    # small answers (5 and 17 rows): the search's full estimates grow with the answer (13 in all, 20 at 41 and 91)
    found = fit(_config(), gpu=GPU, budget=_context() + 40 * MIB, recipe=recipe, seq_len=128, cache=CACHE)
    assert found.micro_batch_size > 2 and found.grad_accum_steps == 2 and found.device == "cuda"  # 5 today
    assert found.global_batch_size == 2 * found.micro_batch_size
    assert found.tokens_per_step == found.global_batch_size * 128
    assert found.predicted_micro_batch_size is not None
    _edges(found, lambda n, b: estimate(_config(), recipe=recipe.replace(micro_batch_size=n), seq_len=128, gpu=GPU,
                                        budget=b))
    # more budget never gives a smaller micro-batch
    more = fit(_config(), gpu=GPU, budget=_context() + 60 * MIB, recipe=recipe, seq_len=128, cache=CACHE)
    assert more.traces == 0  # the first fit's traces, kept by the cache passed
    assert more.micro_batch_size > found.micro_batch_size


def test_fit_on_a_custom_module_grows_its_batch():
    model, example = _gpt(), gpt_batch(batch=2, seq=64)
    seen = []
    found = fit(model, example, loss_fn=lm_loss, gpu=GPU, budget=_context() + 40 * MIB,
                progress=lambda done, total: seen.append((done, total)))
    assert found.tokens_per_step == found.micro_batch_size * 64
    # progress counts traces and estimates, never backwards, and ends complete
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1] == (found.traces + found.estimates,) * 2 and all(t is None or d <= t for d, t in seen)

    def full(n, budget):
        return estimate(model, gpt_batch(batch=n, seq=64), loss_fn=lm_loss, recipe=Recipe(micro_batch_size=n),
                        gpu=GPU, budget=budget)

    _edges(found, full)


def test_fit_on_the_cpu_agrees_with_the_allocator():
    """The independent truth (the CPU allocator's own events, ``memfit.truth``): micro-batch n of
    the answer fits the budget for real and n + 1 does not. On CPU the estimate is byte-exact for
    this model, so the edge is sharp."""
    budget = 5_900_000
    found = fit(_gpt, gpt_batch(batch=2, seq=64), loss_fn=lm_loss, device="cpu", budget=budget)
    n = found.micro_batch_size
    assert found.device == "cpu" and found.reserved_bytes is None and n >= 2
    assert true_peak(_gpt, gpt_batch(batch=n, seq=64), loss_fn=lm_loss) <= budget
    assert true_peak(_gpt, gpt_batch(batch=n + 1, seq=64), loss_fn=lm_loss) > budget


def test_nothing_fits_is_one_line_naming_what_would():
    with pytest.raises(NoBatchFits) as caught:
        fit(_config(), gpu=GPU, budget=_context() + MIB, seq_len=128, cache=CACHE)
    message = str(caught.value)
    assert "\n" not in message and "micro-batch 1" in message
    assert "--allow" in message and "shorter sequence than 128" in message
    assert caught.value.needed_bytes > caught.value.budget_bytes


@pytest.mark.parametrize("kwargs, needle", [
    (dict(seq_len=128), "needs a budget"),
    (dict(budget="1GiB", gpu=GPU, device="cpu"), "conflict"),
    (dict(budget="1GiB", limit=0), "limit"),
    (dict(budget="1GiB", recipe=Recipe(micro_batch_size=2)), "leave it unset"),
])
def test_bad_input_is_one_line(kwargs, needle):
    with pytest.raises(MemfitError, match=needle):
        fit(_config(), **kwargs)


def test_cli_fit_and_estimate_max_batch_size_agree(tmp_path, capsys, monkeypatch):
    """The verbs route their flags to the same fit: ``fit``, ``estimate --max-batch-size``, the human view with
    ``--out`` and nothing-fits. Each CLI call would make a fresh ``EngineCache`` of the same config; here they
    share one (``memfit.planner.fit.fit`` given ``cache=``), so the config is traced once for all of them. The
    API's fit keeps its own cache (the module's): its answer is the CLI's by traces of its own."""
    import memfit.planner.fit as fitting

    shared, real = EngineCache(), fitting.fit
    monkeypatch.setattr(fitting, "fit", lambda *args, **kwargs: real(*args, **{"cache": shared, **kwargs}))
    path = tmp_path / "config.json"
    _config().to_json_file(path)
    budget = f"{(_context() + 120 * MIB) // MIB}MiB"
    common = [str(path), "--gpu", GPU, "--budget", budget, "--seq-len", "128", "--precision", "bf16-mixed", "--json"]
    assert main(["fit", *common]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert main(["estimate", *common, "--max-batch-size"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert fitted["fits"] and fitted["micro_batch_size"] == estimated["micro_batch_size"] > 1
    assert fitted["device_bytes"] == estimated["device_bytes"] <= fitted["budget_bytes"]
    assert fitted["next"]["micro_batch_size"] == fitted["micro_batch_size"] + 1
    api = fit(_config(), gpu=GPU, budget=budget, recipe=Recipe(precision="bf16-mixed"), seq_len=128, cache=CACHE)
    assert api.micro_batch_size == fitted["micro_batch_size"]
    # the human view names the answer, the budget and the next size up; --out writes the recipe
    assert main(["fit", *common[:-1], "--out", str(tmp_path / "r.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"micro-batch {api.micro_batch_size + 1} would need" in out and "tokens per optimizer step" in out
    assert Recipe.load(str(tmp_path / "r.yaml")) == api.recipe
    # nothing fits: exit 1 and a JSON answer; a searched field given as a flag: exit 2
    assert main(["fit", str(path), "--gpu", GPU, "--budget", "1MiB", "--seq-len", "128", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main(["fit", str(path), "--gpu", GPU, "--micro-batch-size", "4"]) == 2
    assert "drop --micro-batch-size" in capsys.readouterr().err
    assert main(["estimate", str(path), "--gpu", GPU, "--max-batch-size", "--batch-size", "4"]) == 2
    assert "drop --batch-size" in capsys.readouterr().err


def test_cli_fit_custom_module(capsys):
    argv = ["fit", f"{ZOO}:GPT", "--batch", f"{ZOO}:gpt_batch", "--loss", f"{ZOO}:lm_loss", "--device", "cpu",
            "--budget", "64MiB", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    n = data["micro_batch_size"]
    full = estimate(GPT, gpt_batch(batch=n), loss_fn=lm_loss, recipe=Recipe(micro_batch_size=n))
    assert data["device_bytes"] == full.peak_bytes <= 64 * MIB < data["next"]["device_bytes"]


def test_cli_plan_custom_module_with_batch_and_loss(capsys):
    budget = _context() + 48 * MIB
    argv = ["plan", f"{ZOO}:GPT", "--batch", f"{ZOO}:gpt_batch", "--loss", f"{ZOO}:lm_loss", "--gpu", GPU,
            "--budget", str(budget), "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    best = Recipe.from_dict(data["best"]["recipe"])
    assert best.micro_batch_size * best.grad_accum_steps == 4  # gpt_batch's rows are the global batch
    full = estimate(GPT, gpt_batch(), loss_fn=lm_loss, recipe=best, gpu=GPU)
    assert data["best"]["device_bytes"] == full.device_bytes <= budget
    assert main([*argv[:-1], "--global-batch-size", "8"]) == 2  # the batch has 4 rows
    assert "conflict" in capsys.readouterr().err


def test_plan_without_repeated_blocks_leaves_checkpointing_out():
    torch.manual_seed(0)
    model = MLP(d=256, hidden=1024)
    batch = (torch.randn(16, 256), torch.randint(0, 10, (16,)))
    plans = plan(model, batch, loss_fn=classify, gpu=GPU, budget=_context() + 128 * MIB)
    assert all(p.recipe.checkpointing == "off" for p in list(plans) + plans.front)
    assert any("no repeated blocks" in reason for reason in plans.best.reasons)
    full = estimate(model, batch, loss_fn=classify, recipe=plans.best.recipe, gpu=GPU)
    assert plans.best.device_bytes == full.device_bytes <= plans.budget


@pytest.mark.parametrize("recipe, path", [(Recipe(), "depth"), (Recipe(grad_accum_steps=2, micro_batch_size=2), "module")])
def test_estimate_progress_ticks_each_phase_and_ends_at_its_total(recipe, path):
    """One tick per forward, backward (per micro-batch) and optimizer phase of each step, and one for the
    replay: one trace on the depth path too (gpt2's 12 blocks: a 4-block copy written out at depth)."""
    seen = []
    if path == "depth":
        report = estimate("gpt2", seq_len=32, recipe=recipe, progress=lambda d, t: seen.append((d, t)))
        assert report.method == "depth"
    else:
        estimate(_gpt(), gpt_batch(batch=4), loss_fn=lm_loss, recipe=recipe, progress=lambda d, t: seen.append((d, t)))
    total = 2 * (2 * recipe.grad_accum_steps + 1) + 1
    assert seen == [(d, total) for d in range(total + 1)]


def test_fit_outside_the_planners_traces_searches_by_full_estimates():
    """attention= is not in the planner's graph key: no prediction, doubling then bisection with full
    estimates, and the same edge."""
    recipe = Recipe(attention="eager")
    found = fit(_config(), gpu=GPU, budget=_context() + 30 * MIB, recipe=recipe, seq_len=64)
    assert found.predicted_micro_batch_size is None and found.traces == 0
    assert any("full estimates only" in note for note in found.notes)
    _edges(found, lambda n, b: estimate(_config(), recipe=recipe.replace(micro_batch_size=n), seq_len=64, gpu=GPU,
                                        budget=b))


def test_an_answer_within_half_a_percent_of_a_cards_budget_says_so_and_how_many_fewer_leave_that():
    """An H200 ran ResNet-50 out of memory at memfit's answer, 51 MB (0.03 %) from the limit, where the card itself is
    not monotone (bench/results/fit-edge-h200.json): such an answer carries a note with the micro-batch that leaves
    0.5 %, from the step to the next size's estimate. A roomy answer carries none."""
    from memfit.planner.fit_result import edge_note

    budget = 150_109_945_856
    (note,) = edge_note(1707, budget, budget - 51_576_832, budget - 51_576_832 + 87_000_000)
    assert "0.03 % of the budget" in note and "micro-batch 1698 leaves 0.5 %" in note
    assert edge_note(15, budget, 145_641_766_912, 147_822_804_992) == []
    (no_step,) = edge_note(280, 25_769_803_776, 25_728_712_704, 25_705_644_032)  # the next size estimated lower
    assert "leaves 0.5 %" not in no_step
