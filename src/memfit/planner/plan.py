"""``plan``: the fastest recipe that fits a byte budget, and why.

The search covers precision x checkpointing (off, selective, every block, every N-th block) x
activation offload x chunked loss x optimizer (the user's, plus 8-bit states or LoRA/QLoRA when
named in ``allow``) x optimizer-in-backward x micro-batch / accumulation (exact divisors of the
global batch). Each candidate gets a predicted peak (allocated bytes, plus what the process holds outside the
allocator on a GPU) and a predicted step time (``cost.py``), and the fastest candidate whose prediction fits is
checked with a full ``estimate``, which replays the caching allocator under the budget
(``fit.py``); a candidate whose verdict is out of memory is passed over, so a plan never exceeds its
budget by the estimate's own account. A plan that fits only with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` may be chosen, and says so.

Only what the estimate accepts is offered: a custom optimizer (a callable) is planned as the user
built it, without ``optimizer_impl`` or 8-bit states (``space.by_name``); a candidate whose trace
the model or step refuses (LoRA without linear layers, a micro-batch of one row under
``BatchNorm1d``, stepping in backward with an optimizer that cannot step one parameter at a time)
is left out (``Engine.offered``), and one whose full estimate refuses it is passed over; the notes
say which and why.

Tracing every candidate would take minutes for an 8B model, so candidates are composed from a
few traces: ``compose.py``.

Written here because no library searches these axes together: Hugging Face's
``auto_find_batch_size`` and Lightning's batch finder try batch sizes on the GPU, DeepSpeed's
autotuner runs GPU trials, torch's ``activation_memory_budget`` is one knob of the compiler.
"""

from __future__ import annotations

import dataclasses
import time

from memfit.planner.cache import EngineCache
from memfit.planner.reasons import _caveats, _front, _nothing_fits, _reasons
from memfit.planner.result import CLEAN_SLOWDOWN, NothingFits, Plan, Plans, clean as _clean
from memfit.planner.space import ALLOWABLE, allowed_names, check_fixed, custom_optimizer, search_space
from memfit.errors import MemfitError, shown
from memfit.estimator.checkpoint import dequantised
from memfit.estimator.inputs import Data, Hardware, gather
from memfit.techniques.recipe import Recipe
from memfit.units import format_size


__all__ = ["plan", "Plan", "Plans", "NothingFits", "ALLOWABLE", "EngineCache"]

NO_BLOCKS = ("checkpointing left out of the search: the model has no repeated blocks to checkpoint "
             "(name modules yourself with checkpointing=modules:a,b)")
CUSTOM_OPTIMIZER = ("optimizer: your own (a callable), planned as you built it: optimizer_impl and 8-bit states "
                    "are not searched (set foreach/fused on your optimizer); run this recipe with the same "
                    "optimizer=, its optimizer field is a placeholder")
MAX_CHECKS = 8  # full estimates tried, fastest first, before giving up on the predictions
SMALLEST_CHECKS = 4  # then the smallest predicted, in full


def plan(model, batch=None, *, hardware: Hardware | None = None, data: Data | None = None, allow=(),
         optimizer="adamw", loss_fn=None, progress=None, cache: EngineCache | None = None, fixed=None,
         budget=None, gpu=None, global_batch_size: int | None = None, seq_len: int | None = None,
         device: str | None = None, gpus: int | None = None, nodes: int | None = None, engines=("torch",)) -> Plans:
    """The fastest recipes for ``model`` that fit ``budget``, fastest first.

        memfit.plan("llama-3.1-8b", hardware=memfit.Hardware(gpu="rtx-4090"),
                    data=memfit.Data(batch_size=64, seq_len=2048), allow=["qlora"])

    model       as for :func:`memfit.estimate` (catalog name, config, nn.Module, factory).
    hardware    a :class:`memfit.Hardware`: ``gpu``, ``budget``, ``device``, ``gpus`` and ``nodes`` below
                (each also a keyword of that name).
    data        a :class:`memfit.Data`: its ``batch_size`` is ``global_batch_size`` below, its ``seq_len``
                ``seq_len`` (each also a keyword).
    batch       for a model without a config: the global batch (dim 0 is split into micro-batches), or
                a zero-argument callable returning it.
    budget      bytes or a size like ``"24GiB"``; default: the ``gpu``'s memory.
    gpu         a catalog GPU (``"rtx-4090"``): CUDA semantics and its speeds. Default ``h100-sxm``
                for speeds when only ``budget`` is given; ``device="cpu"`` plans for the CPU.
    global_batch_size  examples per optimizer step; micro-batch x accumulation divides it exactly.
    allow       names from ``ALLOWABLE`` that may change the math (LoRA, 8-bit states, pure bf16).
    optimizer   the optimizer training uses (``adamw``...); changed only to an allowed 8-bit form. Or
                a callable ``params -> Optimizer`` (your own): planned as you built it, so neither its
                step (``optimizer_impl``) nor 8-bit states are searched; run the plan's recipe with
                the same ``optimizer=`` (the recipe's ``optimizer`` field is then a placeholder).
    progress    ``progress(done, total)`` called as traces complete.
    cache       an ``EngineCache`` to keep the traces in for later calls (a budget sweep passes one to
                every call, and each graph is traced once); default: traced afresh.
    gpus, nodes a data-parallel run: ``gpus`` per node x ``nodes``, each a ``gpu`` with ``budget``; the
                search is DDP / FSDP2 x checkpointing x micro-batch, each candidate a real per-rank
                estimate (``ranks.py``); ``global_batch_size`` is over all ranks.

    engines     the data-parallel engines searched across GPUs: ``"torch"`` (DDP, FSDP2 and its meshes, the
                default), ``"deepspeed"`` (DeepSpeed's ZeRO stages; not yet its offloads), or both, e.g.
                ``("torch", "deepspeed")``; ``deepspeed`` needs 2 GPUs or more (``gpus=``).

    fixed       Recipe fields the user set (a dict, or a Recipe: its non-default fields): every candidate
                has them, and the search varies the rest (``memfit train`` plans so around its flags).
                A math-changing value named here is the user's choice, as if allowed.

    Raises ``NothingFits`` (a ``MemfitError``) when no candidate fits, naming the smallest.
    """
    from memfit.estimator.checks import resolve_target
    from memfit.hardware.gpus import target as default_target
    from memfit.models.source import resolve

    start = time.perf_counter()
    hardware, data = gather(hardware, data, names={"batch_size": "global_batch_size"}, gpu=gpu, budget=budget,
                            device=device, gpus=gpus, nodes=nodes, batch_size=global_batch_size, seq_len=seq_len)
    if data.lengths is not None or data.packed:
        raise MemfitError("plan searches fixed-length rows: drop lengths and packed from data= (estimate takes them)")
    gpu, budget, device, gpus, nodes = hardware.gpu, hardware.budget, hardware.device, hardware.gpus, hardware.nodes
    global_batch_size, seq_len = data.batch_size, data.seq_len
    allowed = allowed_names(allow)
    engines = check_engines(engines)
    if "deepspeed" in engines and (gpus or 1) * (nodes or 1) == 1:
        raise MemfitError("DeepSpeed's ZeRO is planned across GPUs: give gpus=2 or more (on the command line --gpus N; "
                          "ZeRO-Offload on one GPU is not planned yet)")
    for name, value in (("progress", progress), ("loss_fn", loss_fn)):
        if value is not None and not callable(value):
            raise MemfitError(f"{name} must be a callable or None, got {type(value).__name__} {shown(value, 40)}")
    if cache is not None and not isinstance(cache, EngineCache):
        raise MemfitError(f"cache must be a memfit.planner.cache.EngineCache, got {type(cache).__name__}")
    fixed = check_fixed(fixed)
    custom = custom_optimizer(optimizer)
    if "optimizer" in fixed and not custom:
        optimizer = fixed["optimizer"]
    if not custom:
        Recipe(optimizer=optimizer)  # an unknown name is one line naming the choices
    device = device or "cuda"  # (a gpu on the cpu: Hardware refused it)
    target = resolve_target(device, gpu if gpu is not None or str(device).startswith("cpu") else default_target("cuda").gpu)
    if budget is None:
        if target is None or gpu is None:
            raise MemfitError("plan needs a budget: pass budget='24GiB' or a gpu='rtx-4090'")
        budget_bytes = target.working_set_bytes or target.memory_bytes  # a Mac: what keeps it out of swap
    else:
        budget_bytes = budget  # bytes: Hardware read the size
    if target is not None:  # a budget over the card is refused now, not after the search's traces
        from memfit.estimator.verdict import limits

        limits(target, budget_bytes)
        if budget_bytes <= target.outside_bytes:  # nothing can fit: no search (its traces take seconds)
            raise NothingFits(f"nothing fits {format_size(budget_bytes)}: on the {target.name} the CUDA context and "
                              f"the libraries a step loads alone take {format_size(target.outside_bytes)} of a "
                              "budget; give a budget above that", None)
    source, stored = dequantised(resolve(model))
    if callable(batch):  # made once: its rows are the global batch
        batch = batch()
    if batch is not None:
        from memfit.techniques.step import batch_rows

        rows = batch_rows(batch)
        if global_batch_size not in (None, rows):
            raise MemfitError(f"global_batch_size={global_batch_size} and the batch's {rows} rows conflict: set one")
        global_batch_size = rows
    if batch is None and source.config is None:
        raise MemfitError(f"{source.name} has no config to make a batch from: pass batch= (the global batch)")
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise MemfitError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    if seq_len is None and source.config is not None:
        seq_len = source.default_seq_len()
    from memfit.hardware.cluster import world_of

    world = world_of(gpus, nodes)
    if world is not None:
        from memfit.planner.ranks import MAX_SHARD, plan_ranks

        if world.gpus > MAX_SHARD:
            raise MemfitError(f"plan across GPUs takes at most {MAX_SHARD} GPUs per node, got gpus={world.gpus}: a "
                              "node's GPUs share its fast links (NVL72 has 72); give the rest as nodes=")
        if fixed:
            raise MemfitError("plan across GPUs searches its own recipes: drop fixed= (or gpus=)")
        if batch is not None or allowed:
            raise MemfitError("plan across GPUs searches exact recipes of catalog or config models: drop "
                              + ("batch=" if batch is not None else "allow=") + " (or gpus=)")
        if target is None:
            raise MemfitError("plan across GPUs needs a gpu= (the card of every rank)")
        if custom:
            raise MemfitError("plan across GPUs takes the optimizer by name (adamw, adafactor, ...): drop the "
                              "optimizer callable (or gpus=)")
        return plan_ranks(source, target=target, budget_bytes=budget_bytes, world=world,
                          global_batch_size=global_batch_size, seq_len=seq_len, optimizer=optimizer, loss_fn=loss_fn,
                          progress=progress, engines=engines)
    cache = EngineCache() if cache is None else cache
    engine = cache.engine(source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress)
    space = search_space(engine, allowed, optimizer, fixed)
    engine.prepare(space, refusable=True)
    space = [r for r in space if engine.offered(r)]  # what a trace refused, the full estimate would too
    predicted = [engine.predict(r, budget_bytes if target is not None else None) for r in space]
    fitting = sorted((p for p in predicted if p.device_bytes <= budget_bytes), key=_rank)
    notes = list(engine.notes) + _left_out(engine, allowed) + ([stored] if stored else [])
    chosen, report, rejected = None, None, 0
    explicit = None if budget is None else budget_bytes
    refused: list = []  # (recipe, MemfitError): candidates whose full estimate refused them, passed over
    # First the candidates predicted to fit with the measured error to spare, fastest first: the
    # first that fits cleanly by a full estimate (no retry, no expandable segments, not tight) wins.
    # One that fits only on those terms is kept as the fallback; then the rest, as before.
    fallback, tried = None, set()
    roomy = [p for p in fitting if p.device_bytes + _margin(p.device_bytes, target) <= budget_bytes]
    slower = False
    # A candidate over budget by its full estimate shows how far the predictions of its graph fall short;
    # the next ones of that graph are judged by that (a divisor-rich global batch has dozens of micro-batch
    # sizes within 1% of each other at the edge: each would be checked in full, seconds each, and fail).
    short: dict = {}  # graph key -> needed / predicted bytes of the worst miss
    checks = _Checks(engine, short, budget_bytes)
    for candidate in checks.of(roomy):
        if fallback is not None and candidate.step_seconds > fallback[0].step_seconds * CLEAN_SLOWDOWN:
            slower = True  # a clean fit this much slower is a worse answer than a setting
            break
        full = _checked(engine, candidate.recipe, explicit, refused)
        tried.add(candidate.recipe)
        if full is None:
            continue
        if _fits(full, budget_bytes) and _clean(full):
            chosen, report = candidate, full
            break
        if _fits(full, budget_bytes) and fallback is None:
            fallback = (candidate, full)
        checks.learn(candidate, full)
    roomy_choice = chosen is not None
    for candidate in ([] if chosen is not None or fallback is not None else checks.of(fitting)):
        full = _checked(engine, candidate.recipe, explicit, refused)
        if full is None:
            continue
        if _fits(full, budget_bytes):
            chosen, report = candidate, full
            break
        rejected += 1
        checks.learn(candidate, full)
    if chosen is None and fallback is not None:
        chosen, report = fallback
        notes.append(f"recipes that fit cleanly are over {CLEAN_SLOWDOWN:.2f}x slower: this one fits on the terms its "
                     "reasons give" if slower else "no recipe fits with the measured error to spare by a full "
                     "estimate: this one fits on the terms its reasons give")
    if rejected:
        notes.append(f"{rejected} faster candidate(s) predicted to fit were over budget by a full estimate")
    if roomy_choice:
        # by identity: comparing Plans compares their Recipes field by field, and a divisor-rich global
        # batch makes thousands of candidates (a quadratic `in` took minutes at 5040)
        spare, first = {id(p) for p in roomy}, _rank(chosen)
        tight = [p for p in fitting if id(p) not in spare and _rank(p) < first]
        if tight:
            notes.append(f"{len(tight)} faster candidate(s) predicted to fit leave less than the measured estimation "
                         f"error free (the fastest needs {format_size(tight[0].device_bytes)} of "
                         f"{format_size(budget_bytes)}) and were not tried")
    if chosen is None:
        # Predictions are approximate where they interpolate (every N-th block) and leave out the
        # allocator's reserved memory: the smallest few are checked in full before the answer is
        # "nothing fits".
        smallest = sorted(predicted, key=lambda p: (p.device_bytes, p.step_seconds))[:SMALLEST_CHECKS]
        # the smallest is checked for the answer's figure; the others only if they could be near
        smallest = smallest[:1] + [p for p in smallest[1:] if p.device_bytes <= 1.5 * budget_bytes]
        checked = [(p, _checked(engine, p.recipe, explicit, refused)) for p in smallest
                   if p not in fitting[:MAX_CHECKS]]
        checked = [(p, full) for p, full in checked if full is not None]
        if not checked and refused:
            raise refused[0][1]
        fits = sorted(((p, full) for p, full in checked if _fits(full, budget_bytes)),
                      key=lambda pair: _rank(pair[0]))
        if not fits:
            raise _nothing_fits(engine, checked, budget_bytes, allowed)
        chosen, report = fits[0]
        notes.append("chosen among the smallest predicted recipes, checked in full")
    if refused:
        notes.append(f"{len(refused)} candidate(s) passed over: their full estimate refused them (the first, "
                     f"{refused[0][0].describe()}: {refused[0][1]})")
    exact = Plan(chosen.recipe, report.peak_bytes, report.reserved_bytes, report.device_bytes, chosen.step_seconds,
                 chosen.samples_per_second, chosen.tokens_per_second, verified=True, verdict=report.verdict, seq_len=seq_len)
    reasons = _reasons(exact, chosen, predicted, budget_bytes, engine) + _caveats(report)
    if custom:
        reasons.append(CUSTOM_OPTIMIZER)
    if not engine.has_blocks:
        reasons.append(NO_BLOCKS)
    exact = Plan(**{**exact.__dict__, "reasons": tuple(reasons)})
    passed_over = {r for r, _ in refused}
    first = _rank(chosen)
    rest = [dataclasses.replace(p, seq_len=seq_len) for p in fitting
            if p.recipe != chosen.recipe and _rank(p) >= first and p.recipe not in passed_over]
    settings = {"model": source.name, "global_batch_size": global_batch_size, "seq_len": seq_len,
                "optimizer": _optimizer_setting(optimizer), "allow": sorted(allowed), "fixed": fixed,
                "traces": engine.traces, "replays": engine.replays,
                "speed": engine.speed.name}
    return Plans([exact] + rest, budget=budget_bytes, device="cpu" if target is None else "cuda",
                 gpu=None if target is None else target.name, candidates=len(predicted),
                 front=_front(predicted), seconds=time.perf_counter() - start, report=report,
                 settings=settings, notes=notes)


def _optimizer_setting(optimizer) -> str:
    """``optimizer`` as the plan's settings show it: the name, or ``custom:`` and the callable's name."""
    if not custom_optimizer(optimizer):
        return optimizer
    return "custom:" + str(getattr(optimizer, "__qualname__", None) or type(optimizer).__name__)


def _left_out(engine, allowed: set[str]) -> list[str]:
    """Notes on what the search left out for this model and step: the 8-bit forms ``allow`` named,
    with a custom optimizer; and what its traces refused (``Engine.offered``), each with the reason."""
    from memfit.planner.compose import _trace_fields
    from memfit.techniques.optimizer import SEARCH_APPROXIMATE

    out = []
    named = sorted(a for a in allowed if a in SEARCH_APPROXIMATE)
    if engine.factory is not None and named:
        out.append(f"allow={','.join(named)} left out: your optimizer is a callable, which memfit cannot make 8-bit; "
                   "pass its name (optimizer='adamw') to search 8-bit states")
    default = Recipe(optimizer=engine.recipe_optimizer).to_dict()
    common: dict[str, set] = {}  # reason -> the field values every trace refused for it has set
    for (kind, key), reason in engine.refused.items():
        values = {(k, v) for k, v in zip(_trace_fields(kind), key) if default.get(k) != v}
        common[reason] = values if reason not in common else common[reason] & values
    for reason, values in common.items():
        what = ", ".join(f"{k}={v}" for k, v in sorted(values, key=lambda kv: Recipe.fields().index(kv[0])))
        out.append(f"{what or 'some techniques'} left out: refused for this model ({reason})")
    if 1 in engine.no_mb:
        out.append(f"micro_batch_size=1 left out: the model refused a batch of one row ({engine.no_mb[1]})")
    if engine.no_inbwd:
        reason = next(iter(engine.no_inbwd.values()))
        out.append(f"optimizer_in_backward left out: stepping in backward could not be traced ({reason})")
    return out


def _checked(engine, recipe: Recipe, budget: int | None, refused: list | None = None):
    """The full estimate of ``recipe`` with its verdict under ``budget`` (None: the whole card).

    The whole-card estimate is traced once per recipe; under a budget the allocator must be replayed
    again only if its unlimited reserved peak does not fit below the budget (if it does, nothing
    ever reaches the limit and the budgeted run is the same run); ``Engine.verify`` then replays the
    whole-card trace's events under the budget where that estimate was one plain trace, and estimates
    again under the budget only where it was not (``estimator/rebudget.py``). With ``refused``, a recipe the
    estimate refuses (a technique this model or batch cannot take, which the composed traces did
    not show) is added to it and None returned: the search passes it over instead of ending."""
    try:
        full = engine.verify(recipe)
    except MemfitError as err:
        if refused is None:
            raise
        refused.append((recipe, err))
        return None
    if budget is None or full.verdict is None:
        return full
    from memfit.estimator.verdict import FITS, fit_reserved, limits

    if full.verdict == FITS and not full.retries and full.reserved_bytes <= limits(engine.target, budget)[0]:
        managed = (full.managed_bytes or 0, full.managed_resident_bytes or 0)
        return dataclasses.replace(full, **fit_reserved(full.peak_bytes, full.reserved_bytes, engine.target,
                                                        budget, managed).report_fields())
    return engine.verify(recipe, budget)


class _Checks:
    """Which candidates predicted to fit get a full estimate: at most ``MAX_CHECKS`` of a list, fastest
    first, passing over those whose graph's predictions a full estimate found short (``learn``) by
    enough to put them over the budget."""

    def __init__(self, engine, short: dict, budget: int):
        self.engine, self.short, self.budget = engine, short, budget

    def of(self, pool):
        done = 0
        for p in pool:
            if done >= MAX_CHECKS:
                return
            if p.device_bytes * self.short.get(self.engine._graph_key(p.recipe), 1.0) > self.budget:
                continue
            done += 1
            yield p

    def learn(self, p, full) -> None:
        """``full``, the full estimate of candidate ``p``: if it does not fit, how far short ``p``'s prediction was."""
        if _fits(full, self.budget):
            return
        needed = full.device_bytes + (full.missing_bytes or 0)
        key = self.engine._graph_key(p.recipe)
        self.short[key] = max(self.short.get(key, 1.0), needed / max(p.device_bytes, 1))


def _margin(nbytes: int, target) -> int:
    """The measured estimation error a plan should leave free on a GPU (``verdict.error_margin``)."""
    if target is None:
        return 0
    from memfit.estimator.verdict import error_margin

    return error_margin(nbytes)


def _fits(report, budget: int) -> bool:
    """By the verdict on a GPU (``fit.py``), by the peak on the CPU."""
    if report.verdict is not None:
        from memfit.estimator.verdict import runs

        return runs(report.verdict)
    return report.device_bytes <= budget


def _rank(p: Plan):
    return (round(p.step_seconds, 9), p.device_bytes, p.recipe.describe())


def check_engines(engines) -> tuple:
    """``engines`` as a tuple of names from ``ENGINES`` (a name or a comma-separated text is one too)."""
    from memfit.planner.data_parallel import ENGINES

    names = [n.strip() for n in engines.split(",")] if isinstance(engines, str) else engines
    try:
        found = tuple(dict.fromkeys(names))
    except TypeError:
        found = None
    if not found or not all(isinstance(n, str) and n in ENGINES for n in found):
        raise MemfitError(f"engines={shown(engines, 40)} is not a set of data-parallel engines: use "
                          f"{' or '.join(ENGINES)}, or both (e.g. engines=('torch', 'deepspeed'))")
    return tuple(n for n in ENGINES if n in found)
