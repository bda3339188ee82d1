"""The failing step estimated, and each fix: ``Failing`` (what ``memfit doctor`` knows of the model that ran
out) and ``run_step`` (real CPU steps under a virtual budget: how a scenario runs out and how a fix is checked
for real). The ranking and the cause vocabulary are described in ``doctor.py``."""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.profiling.findings import (ALLOC_CONF, RECIPE_CAUSES, Diagnosis, Fix, fragmentation_fix, message_cause,
                                       other_process_fix)
from memfit.profiling.oom_text import OomMessage
from memfit.units import format_size

__all__ = ["Failing", "run_step"]


class Failing:
    """The failing step as ``estimate`` takes it, where it ran and what the process could use there."""

    def __init__(self, *, source, batch, loss_fn, recipe, batch_size, seq_len, target, capacity, card, allow, label,
                 notes, search):
        self.model, self.batch, self.loss_fn, self.recipe = source, batch, loss_fn, recipe
        self.batch_size, self.seq_len, self.target = batch_size, seq_len, target
        self.capacity = capacity  # what the process could use (bytes; on a GPU the CUDA context included)
        self.card = card  # the whole device: other processes' memory included
        self.allow, self.label, self.notes = allow, label, tuple(notes)
        self.search = search  # offer memfit plan's answer
        self.cache = None  # the planner's traces, shared by ``plan_fix`` and ``speeds``

    @classmethod
    def of(cls, message, *, model, batch, loss_fn, recipe, batch_size, seq_len, gpu, budget, allow, label,
           profile, search) -> "Failing":
        from memfit.techniques.recipe import Recipe
        from memfit.units import parse_size

        notes = []
        if model is not None:  # an unknown name is one line naming the choices (without a model: unused)
            from memfit.planner.space import allowed_names

            allow = allowed_names(allow)
        recipe = Recipe.from_dict(recipe) if isinstance(recipe, dict) else recipe or Recipe()
        cuda = gpu is not None or (message is not None and message.kind.startswith("cuda"))
        target = _card(gpu, message, notes) if cuda and (model is not None or gpu is not None) else None
        capacity = parse_size(budget) if budget is not None else _room(message, target)
        if capacity is None and target is not None:
            capacity = target.memory_bytes
        if capacity is None and isinstance(profile, dict):  # the budget it ran under, else what was live
            settings = profile.get("settings") if isinstance(profile.get("settings"), dict) else {}
            capacity = settings.get("budget") or (profile.get("oom") or {}).get("live_bytes")
        if target is not None and capacity is not None and capacity > target.memory_bytes:
            notes.append(f"the capacity {format_size(capacity)} is over the {target.name}'s "
                         f"{format_size(target.memory_bytes)}: estimated under the card's")
            capacity = target.memory_bytes
        card = (message.capacity if message is not None and message.capacity else capacity)
        source = None
        if model is not None:
            from memfit.models.source import resolve

            source = resolve(model)
            if capacity is None:
                raise MemfitError("the message does not say how much memory there was (the CPU allocator's does "
                                  "not): pass --budget, e.g. the machine's free RAM")
            if seq_len is None and source.config is not None:
                seq_len = source.default_seq_len()
            if batch_size is None and batch is None:
                batch_size = (recipe.micro_batch_size or 1) * recipe.grad_accum_steps
        return cls(source=source, batch=batch, loss_fn=loss_fn, recipe=recipe, batch_size=batch_size, seq_len=seq_len,
                   target=target, capacity=capacity, card=card, allow=allow,
                   label=label if label is not None else (model if isinstance(model, str) else "MODEL"), notes=notes, search=search)

    # -- the step and its fit ------------------------------------------------------------------------------
    def run(self, recipe, budget: int | None = -1):
        """The estimate of ``recipe``'s step; on a GPU under ``budget`` (default: the capacity)."""
        from memfit.estimator.estimate import estimate

        budget = self.capacity if budget == -1 else budget
        return estimate(self.model, self.batch, loss_fn=self.loss_fn, recipe=recipe,
                        batch_size=self.batch_size if self.batch is None else None, seq_len=self.seq_len,
                        device="cpu" if self.target is None else "cuda", gpu=self.target,
                        budget=budget if self.target is not None else None)

    def fits(self, report) -> bool:
        if report.verdict is not None:
            from memfit.report.report import OOM

            return report.verdict != OOM
        return report.device_bytes <= self.capacity

    def context(self) -> int:
        return 0 if self.target is None else self.target.outside_bytes

    # -- the cause -----------------------------------------------------------------------------------------
    def diagnose(self, message: OomMessage | None, found: Diagnosis | None) -> Diagnosis:
        base = self.run(self.recipe)
        evidence = self.evidence(base)
        figures = message.to_dict() if message is not None else found.figures if found is not None else {}
        if self.fits(base):
            return self.fitting(base, message, found, figures, evidence)
        if self.target is not None and message is not None and message.other_bytes:
            whole = self.run(self.recipe, min(self.card, self.target.memory_bytes))
            if self.fits(whole):
                fix = other_process_fix(message, fits=True)
                summary = (f"the step needs {format_size(_need(base))}: it fits the whole card, not the "
                           f"{format_size(self.capacity)} left beside other processes' "
                           f"{format_size(message.other_bytes)}")
                return self.answer("other_process", summary, figures, evidence, base, [fix])
        cause, summary = self.model_cause(base)
        extra = [] if message is None else [f for f in [message_cause(message)[2]] if f is not None]
        return self.answer(cause, summary, figures, evidence, base, extra)

    def fitting(self, base, message, found, figures, evidence) -> Diagnosis:
        """The step fits by the estimate: expandable segments, or what the message or profile say."""
        from memfit.report.report import EXPANDABLE

        if base.verdict == EXPANDABLE:
            summary = (f"the step needs {format_size(base.device_bytes)} of {format_size(self.capacity)}: it fits "
                       "only with expandable segments (the caching allocator fragments without them)")
            cached = max((base.reserved_bytes or 0) - base.peak_bytes, 0)  # reserved over allocated, at the peak
            fix = fragmentation_fix(cached, True, self.command(self.recipe))
            return self.answer("fragmentation", summary, figures, evidence, base, [fix])
        cause, summary, fix = message_cause(message) if message is not None else ("unknown", "", None)
        if cause == "unknown" and found is not None:
            return self.extend(found)
        if cause == "unknown":
            summary = (f"the step fits by the estimate ({format_size(base.device_bytes)} of "
                       f"{format_size(self.capacity)}): what ran out is outside it (a leak, an evaluation with grad "
                       "enabled, a longer batch); run the script under the profiler: memfit doctor --budget SIZE -- "
                       "python train.py")
        return self.answer(cause, summary, figures, evidence, base, [fix] if fix else [])

    def model_cause(self, base) -> tuple[str, str]:
        cat, cap, ctx = base.by_category, format_size(self.capacity), self.context()
        plus = f" with the {format_size(ctx)} outside torch's allocator (CUDA context, libraries)" if ctx else ""
        states = base.model_state_bytes
        if states + ctx > self.capacity:
            return "model_states", (f"parameters {format_size(cat.get('parameters', 0))}, gradients "
                                    f"{format_size(cat.get('gradients', 0))} and optimizer state "
                                    f"{format_size(cat.get('optimizer_state', 0))} need {format_size(states + ctx)} "
                                    f"on their own{plus}, over the {cap} the process could use")
        peaks = base.phase_peaks
        graph = max(peaks.get("forward", 0), peaks.get("backward", 0))
        if peaks.get("optimizer", 0) > graph and graph + ctx <= self.capacity:
            return "optimizer_temporaries", (f"the optimizer step needs {format_size(peaks['optimizer'] + ctx)}{plus}, "
                                             f"over the {cap} the process could use; forward and backward need "
                                             f"{format_size(graph + ctx)}")
        held = cat.get("activations", 0) + cat.get("temporaries", 0)
        return "activations", (f"the step needs {format_size(_need(base))} against {cap}: activations and "
                               f"temporaries hold {format_size(held)} at the peak beside {format_size(states)} of "
                               "model states")

    def evidence(self, base) -> dict:
        return {"source": "estimate", "device": self.target.name if self.target else "cpu",
                "capacity_bytes": self.capacity, "needed_bytes": _need(base), "verdict": base.verdict,
                "model_state_bytes": base.model_state_bytes, "phase_peaks": dict(base.phase_peaks),
                "by_category": {k: v for k, v in base.by_category.items() if v}, "recipe": self.recipe.describe(),
                "batch_size": self.batch_size, "seq_len": self.seq_len}

    def answer(self, cause, summary, figures, evidence, base, direct) -> Diagnosis:
        """The fixes ranked (``_rank``); a cause outside the recipe keeps its direct fix first."""
        fixes = self.recipe_fixes(cause, base)
        first = [] if cause in RECIPE_CAUSES else direct[:1]
        ranked = first + sorted(fixes + direct[len(first):], key=_rank)
        if cause in RECIPE_CAUSES and not any(f.fits for f in ranked) and not self.allow:
            self.notes += ("no exact fix fits: --allow lora,qlora,adamw8bit,bf16 lets fixes that change the math "
                           "be tried",)
        return Diagnosis(cause, summary, figures, tuple(ranked), evidence, self.notes)

    def extend(self, found: Diagnosis) -> Diagnosis:
        """A profile's diagnosis, its direct fix first and then the plan for the model."""
        base = self.run(self.recipe)
        plan = self.recipe_fixes("unknown", base)
        return Diagnosis(found.cause, found.summary, found.figures, found.fixes + tuple(plan),
                         {**found.evidence, **self.evidence(base), "source": found.evidence.get("source")}, self.notes)

    # -- the fixes -----------------------------------------------------------------------------------------
    def candidates(self, cause: str) -> list[tuple[str, dict]]:
        """One change each to the failing recipe, for ``cause``: (name, fields changed)."""
        r, cuda = self.recipe, self.target is not None
        # offload_optimizer is not offered: it runs on a real GPU only, so no estimate can check it
        out = {"model_states": [("optimizer_in_backward", {"optimizer_in_backward": True})],
               "optimizer_temporaries": [("optimizer_forloop", {"optimizer_impl": "forloop"}),
                                         ("safe_step", {"safe_step": 8}),
                                         ("optimizer_in_backward", {"optimizer_in_backward": True})],
               "activations": [("checkpointing", {"checkpointing": "blocks"}),
                               ("bf16_mixed", {"precision": "bf16-mixed"}), ("chunked_loss", {"chunked_loss": 8}),
                               ("sdpa_attention", {"attention": "sdpa"})]
               # on the CPU the host is the device: offloading activations there frees nothing
               + ([("offload_activations", {"offload_activations": True})] if cuda else [])}.get(cause, [])
        math = [("adamw8bit", {"optimizer": "adamw8bit"}), ("paged_adamw8bit", {"optimizer": "paged_adamw8bit"}),
                ("lora", {"lora": "lora"}), ("qlora", {"lora": "qlora"}), ("bf16", {"precision": "bf16"})]
        if cause in RECIPE_CAUSES:
            out = out + [(name, change) for name, change in math if name in self.allow]
        return [(name, change) for name, change in out if any(getattr(r, k) != v for k, v in change.items())]

    def recipe_fixes(self, cause: str, base) -> list[Fix]:
        tried = []  # (name, recipe, report)
        for name, change in self.candidates(cause):
            tried += self.attempt(name, lambda change=change: self.recipe.replace(**change))
        if cause == "activations":
            tried += self.smaller_micro_batch()
        tried += self.plan_fix() if self.search else []
        fitting = {recipe for _, recipe, report in tried if not isinstance(report, int) and self.fits(report)}
        seconds = self.speeds([self.recipe, *fitting]) if fitting else {}  # only what can rank first is timed
        fixes = []
        for name, recipe, report in tried:
            saves = _need(base) - (report if isinstance(report, int) else _need(report))
            if saves <= 0 and name != "plan":
                continue
            fixes.append(Fix(name, saves, recipe in fitting, self.speed_cost(recipe, seconds), recipe.to_dict(),
                             self.command(recipe, report), _changes_math(self.recipe, recipe),
                             why=self.why(name, recipe, report)))
        return fixes

    def why(self, name: str, recipe, report) -> str:
        from memfit.report.report import EXPANDABLE

        before, after = self.recipe.to_dict(), recipe.to_dict()
        changed = ", ".join(f"{k}={v}" for k, v in after.items() if before[k] != v)
        text = f"memfit plan's fastest recipe that fits: {changed}" if name == "plan" else changed
        if isinstance(report, int):
            text += " (the smallest plan found: nothing fits)"
        elif report.verdict == EXPANDABLE:
            text += f" (fits only with {ALLOC_CONF})"
        return text

    def attempt(self, name, make) -> list:
        try:
            recipe = make()
            return [(name, recipe, self.run(recipe))]
        except MemfitError as err:  # a change this model or recipe refuses is no fix
            self.notes += (f"{name} left out: {err}",)
            return []

    def smaller_micro_batch(self) -> list:
        """The largest micro-batch below the failing one that fits (accumulation keeps the global batch);
        at most three sizes tried, the last tried when none fits."""
        from memfit.techniques.accumulation import divisors

        if self.batch is not None or not self.batch_size:
            return []
        micro = self.recipe.micro_batch_size or self.batch_size // self.recipe.grad_accum_steps
        found = []
        for size in [d for d in reversed(divisors(self.batch_size)) if d < micro][:3]:
            name = f"micro_batch_{size}x{self.batch_size // size}"
            found = self.attempt(name, lambda size=size: self.recipe.replace(
                micro_batch_size=size, grad_accum_steps=self.batch_size // size))
            if found and self.fits(found[0][2]):
                break
        return found

    def plan_fix(self) -> list:
        """``memfit plan``'s fastest recipe for the capacity (its full estimate), or the smallest when none
        fits (its predicted bytes, an int)."""
        from memfit.planner.plan import NothingFits, plan

        try:
            plans = plan(self.model, self.batch, budget=self.capacity, gpu=self.target,
                         device="cpu" if self.target is None else "cuda",
                         global_batch_size=self.batch_size if self.batch is None else None, seq_len=self.seq_len,
                         allow=self.allow, optimizer=self.recipe.optimizer, loss_fn=self.loss_fn, cache=self.engines())
            return [("plan", plans.best.recipe, plans.report)]
        except NothingFits as err:
            return [] if err.smallest is None else [("plan", err.smallest.recipe, err.smallest.device_bytes)]
        except MemfitError as err:
            self.notes += (f"plan left out: {err}",)
            return []

    def speeds(self, recipes) -> dict:
        """Predicted step seconds of each recipe by the planner's cost model (those it can time)."""
        if self.batch_size is None:
            return {}
        engine = self.engines().engine(self.model, self.batch, self.target, self.seq_len, self.loss_fn,
                                       self.recipe.optimizer, self.batch_size, None)
        normal = {r: r if r.micro_batch_size else r.replace(micro_batch_size=self.batch_size // r.grad_accum_steps)
                  for r in recipes}
        try:
            engine.prepare([n for n in normal.values() if engine.offered(n)], refusable=True)
        except MemfitError:
            return {}
        out = {}
        for r, n in normal.items():
            if engine.offered(n):
                try:
                    out[r] = engine.predict(n).step_seconds
                except (MemfitError, KeyError):  # a trace the search space never needed
                    pass
        return out

    def engines(self):
        if self.cache is None:
            from memfit.planner.cache import EngineCache

            self.cache = EngineCache()
        return self.cache

    def speed_cost(self, recipe, seconds: dict) -> float | None:
        from memfit.techniques.registry import techniques

        untimed = {f.name for t in techniques() if t.trace == "none" for f in t.fields}
        if any(getattr(recipe, k) != getattr(self.recipe, k) for k in untimed):
            return None
        if recipe not in seconds or self.recipe not in seconds:
            return None
        return seconds[recipe] / seconds[self.recipe]

    def command(self, recipe, report=None) -> str:
        """``memfit estimate`` of the fixed step under the same capacity (it says whether it fits)."""
        from memfit.report.report import EXPANDABLE

        env = f"{ALLOC_CONF} " if getattr(report, "verdict", None) == EXPANDABLE else ""
        if self.label == "":  # a script's own model (``memfit doctor -- python train.py``): the recipe to apply
            changed = {k: v for k, v in recipe.to_dict().items() if v != type(recipe)().to_dict().get(k)}
            args = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            return (env + f"in the script: model, optimizer, step = memfit.apply(model, memfit.Recipe({args})); "
                    "loss = step(batch) each step")
        parts = ["memfit", "estimate", str(self.label)]
        if self.batch_size:
            parts += ["--batch-size", str(self.batch_size)]
        if self.seq_len:
            parts += ["--seq-len", str(self.seq_len)]
        parts += ["--gpu", self.target.name] if self.target is not None else ["--device", "cpu"]
        parts += ["--budget", _size_arg(self.capacity)] + _flags(recipe)
        return env + " ".join(parts)


def _room(message: OomMessage | None, target) -> int | None:
    """What the process could use by the message: the device less the other processes, or its cap plus the
    memory outside the allocator (torch's cap is on what it reserves; memfit's budget includes the rest)."""
    if message is None or message.capacity is None:
        return None
    room = message.capacity - message.other_bytes
    if message.allowed is not None:
        room = min(room, message.allowed + (target.outside_bytes if target is not None else 0))
    return room


def _card(gpu, message: OomMessage | None, notes: list):
    """The catalog GPU: the one named, else the one whose memory the message's capacity is (within 2 %)."""
    from memfit.estimator.estimate import DEFAULT_GPU
    from memfit.hardware.gpus import CATALOG, gpu as lookup, visible_gpu

    if gpu is not None:
        return gpu if not isinstance(gpu, str) else lookup(gpu)
    capacity = message.capacity if message is not None else None
    # the cards of the message's runtime: ROCm's says "HIP out of memory" (an RX 7900 XTX and an RTX 4090 have 24 GiB)
    vendor = "amd" if message is not None and "HIP out of memory" in (message.message or "") else "nvidia"
    cards = [card for card in CATALOG.values() if card.vendor == vendor]
    if capacity:
        best = min(cards, key=lambda c: abs(c.memory_bytes - capacity))
        if abs(best.memory_bytes - capacity) <= 0.02 * capacity:
            notes.append(f"GPU taken as {best.name}: its memory is nearest the message's {format_size(capacity)} "
                         "capacity (pass --gpu to name yours)")
            return best
    seen = visible_gpu()
    if seen is not None:
        notes.append(f"GPU taken as {seen.name}, the one torch sees (pass --gpu to name another)")
        return seen
    notes.append(f"no catalog GPU has the message's capacity and none is visible: {DEFAULT_GPU} semantics under it "
                 "(pass --gpu)")
    return lookup(DEFAULT_GPU)


def _need(report) -> int:
    """Device bytes the step needs: an estimate that ran out under the budget stops there, and says how
    much more it missed."""
    return report.device_bytes + (report.missing_bytes or 0)


def _rank(fix: Fix) -> tuple:
    return (not fix.fits, fix.speed_cost if fix.speed_cost is not None else float("inf"), -(fix.saves_bytes or 0))


def _changes_math(before, after) -> bool:
    return bool(set(after.approximations) - set(before.approximations))


def _flags(recipe) -> list[str]:
    """The CLI flags that set ``recipe``'s non-default fields (``cli/_recipe_flags.py``'s names)."""
    from memfit.techniques.recipe import Recipe

    default, out = Recipe(), []
    for name, value in recipe.to_dict().items():
        if getattr(default, name) == value:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True or value is False:
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def _size_arg(nbytes: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def run_step(model, recipe=None, *, batch_size: int = 1, seq_len: int | None = None, budget, steps: int = 2,
             seed: int = 0) -> str | None:
    """Run ``steps`` real training steps of ``recipe`` on the CPU under a virtual budget of ``budget`` bytes
    (``accounting/budget.py``: the model's parameters and buffers count as resident); the out-of-memory
    message, or None when the steps fit. What ``doctor`` checks a fix with, and how a scenario fails."""
    import torch

    from memfit.accounting.budget import VirtualBudget
    from memfit.models.source import resolve
    from memfit.techniques.apply import run_steps
    from memfit.techniques.recipe import Recipe

    source = resolve(model)
    torch.manual_seed(seed)
    module = source.build()
    resident = sum(t.untyped_storage().nbytes() for t in
                   {t.untyped_storage().data_ptr(): t for t in [*module.parameters(), *module.buffers()]}.values())
    try:
        with VirtualBudget(budget, resident=resident):
            batch = source.make_batch(batch_size, seq_len)  # inside: the batch counts, as in an estimate
            run_steps(module, batch, recipe=recipe or Recipe(), steps=steps)
    except torch.OutOfMemoryError as err:
        return str(err)
    return None
