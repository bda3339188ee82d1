"""``diagnose``: why a training run ran out of memory, and the fixes ranked by the bytes they save.

The evidence, any of which may be given: torch's out-of-memory message (``oom_text.py``: pasted, or
the last one in a log), the model and recipe that failed (estimated with :func:`memfit.estimate` on the
device of the message), and a memfit profile of the run (``diagnose_profile``: its ``to_dict()`` form,
or the saved JSON). The answer is one **cause**, from a fixed vocabulary (``CAUSES``):

model_states           parameters + gradients + optimizer state alone exceed what the process could use
activations            the forward / backward peak (saved activations, temporaries) passes it
optimizer_temporaries  the optimizer step's peak (foreach scratch) is the highest and the one over
fragmentation          memory reserved by PyTorch but unallocated (in segments it cannot release) would
                       have served the request: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
other_process          other processes hold the memory the request lacked
leak                   memory that grows step after step (a profile's ``leaks``) is much of what was live
eval_without_no_grad   a forward with grad enabled whose saved activations no backward consumed (a profile)
long_batch             the step that ran out had far more tokens than the median step (a profile)
unknown                none of these is shown by the evidence given

How it is decided. From the message alone: other processes holding at least what the request lacked
(and ``SHARE`` of the card) is ``other_process``; reserved-but-unallocated bytes that large is
``fragmentation``. With the model, its step is estimated under what the process could use (the card
less the other processes, or the cap): model states over it is ``model_states``; the optimizer phase
the highest and the forward / backward under it is ``optimizer_temporaries``; else ``activations``. An
estimate that fits only with expandable segments is ``fragmentation``, one that fits the whole card but
not beside the other processes is ``other_process``; one that fits falls back to the message's rules.
A profile's leak, grad-enabled evaluation or long batch outranks the model's answer.

The fixes. For ``model_states``, ``activations`` and ``optimizer_temporaries`` each candidate is one
change to the failing recipe (checkpointing, bf16-mixed, a smaller micro-batch with accumulation keeping
the global batch, chunked loss, SDPA, activation offload; stepping in backward, optimizer offload; a
for-loop or chunked optimizer step; 8-bit states, LoRA, QLoRA, pure bf16 only when ``allow`` names them:
exact by default), plus ``memfit plan``'s answer for the budget. Each is a full estimate:
``saves_bytes`` is the failing step's device bytes less the candidate's, ``fits`` whether it fits, and
``speed_cost`` its step time over the failing one's by the planner's cost model (``planner/cost.py``;
only fixes that fit are timed; None where the model does not time the technique changed: optimizer
offload, the chunked step). On CPU semantics the cost model first measures this CPU (``Speed.host``:
seconds, once per process). For
the other causes the first fix is the direct one (the environment variable, freeing the other process,
the leak's file:line, ``torch.no_grad()``, capping the length), then ``memfit plan``'s recipe when the
model is given.

Ranking: fixes that fit first, then the lower speed cost (unknown last), then the more bytes saved;
for a cause outside the recipe its direct fix stays first.

``Diagnosis.exit_code`` is what ``memfit doctor`` exits with: 0 diagnosed and a fix that fits found,
3 diagnosed but no fix fits (or the cause is unknown), 4 no out-of-memory in the input (``NoOomFound``);
bad input is a ``MemfitError`` (exit 2).

Known limitations: one message names one allocation, not the step, so without the model or a profile
only ``fragmentation`` and ``other_process`` can be told; a leak, a grad-enabled evaluation or a long
batch need a profile; figures read from a message are within a hundredth of their unit.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from memfit.errors import MemfitError
from memfit.profiling.oom_text import OomMessage, parse_oom
from memfit.units import format_size

__all__ = ["diagnose", "diagnose_profile", "Diagnosis", "Fix", "NoOomFound", "CAUSES", "EXIT_FITS", "EXIT_NO_FIX",
           "EXIT_NO_OOM"]

CAUSES = ("model_states", "activations", "optimizer_temporaries", "fragmentation", "other_process", "leak",
          "eval_without_no_grad", "long_batch", "unknown")
RECIPE_CAUSES = ("model_states", "activations", "optimizer_temporaries")
EXIT_FITS, EXIT_NO_FIX, EXIT_NO_OOM = 0, 3, 4
SHARE = 0.05  # of the capacity: other processes' or fragmented bytes below this are noise, not the cause
PROFILE_SHARE = 0.2  # of the live bytes at the OOM: a leak or a grad-enabled forward this large is the cause
LONG_FACTOR = 1.5  # tokens over the median step's that make the step that ran out a long batch
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


class NoOomFound(MemfitError):
    """The input holds no out-of-memory error (``memfit doctor`` exits 4)."""


@dataclass(frozen=True)
class Fix:
    """One way out, with what it buys.

    name          what it is ("checkpointing", "expandable_segments", "plan", ...)
    saves_bytes   device bytes it saves (the failing step's less the fixed one's); None when unknown
    fits          whether the fixed step fits (None: cannot be told from the evidence)
    speed_cost    fixed step time over the failing one's (1.0 = as fast), by the planner's cost model;
                  None when it does not time the technique changed, and for a fix that does not fit (not timed)
    recipe        the fixed ``Recipe.to_dict()``, for a recipe fix
    command       what to run or change
    changes_math  a technique that changes the math (8-bit states, LoRA, pure bf16)
    why           one line on what it does here
    """

    name: str
    saves_bytes: int | None
    fits: bool | None
    speed_cost: float | None = None
    recipe: dict | None = None
    command: str | None = None
    changes_math: bool = False
    why: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "saves_bytes": self.saves_bytes, "fits": self.fits,
                "speed_cost": None if self.speed_cost is None else round(self.speed_cost, 3), "recipe": self.recipe,
                "command": self.command, "changes_math": self.changes_math, "why": self.why}


@dataclass(frozen=True)
class Diagnosis:
    """The cause (one of ``CAUSES``), a line saying why with the figures, and the ranked fixes.

    figures   the message's figures (``OomMessage.to_dict()``), or the profile's OOM; {} without
    evidence  the numbers that decided: capacity_bytes, needed_bytes, model_state_bytes, phase_peaks...
    notes     what was assumed (a GPU guessed from the capacity) or left out
    """

    cause: str
    summary: str
    figures: dict = field(default_factory=dict)
    fixes: tuple[Fix, ...] = ()
    evidence: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        return EXIT_FITS if self.cause != "unknown" and any(f.fits for f in self.fixes) else EXIT_NO_FIX

    def to_dict(self) -> dict:
        return {"cause": self.cause, "summary": self.summary, "figures": self.figures,
                "fixes": [f.to_dict() for f in self.fixes], "evidence": self.evidence, "notes": list(self.notes),
                "exit_code": self.exit_code}


def diagnose(error=None, *, profile: dict | None = None, model=None, batch=None, loss_fn=None, recipe=None,
             batch_size: int | None = None, seq_len: int | None = None, gpu=None, budget=None, allow=(),
             plan: bool = True, label: str | None = None) -> Diagnosis:
    """Name the cause of an out-of-memory error and rank the fixes.

    error      torch's message, a log or traceback holding it (the last one counts), or an ``OomMessage``
    profile    a memfit profile's ``to_dict()`` (or its saved JSON, loaded)
    model      the model that ran out, as :func:`memfit.estimate` takes it; ``batch``, ``loss_fn``,
               ``recipe``, ``batch_size`` (examples per optimizer step) and ``seq_len`` as there
    gpu        the catalog GPU it ran on (default: the one whose memory the message's capacity is)
    budget     what the process could use (default: the message's capacity less other processes)
    allow      techniques that change the math the fixes may use (``memfit plan``'s ``allow``)
    plan       offer ``memfit plan``'s recipe as a fix (a search: tens of seconds even for a small model)
    label      how the model is named in the fixes' commands (default: the model, if a string)

    Raises ``NoOomFound`` when neither ``error`` nor ``profile`` holds an out-of-memory error.
    """
    message = error if isinstance(error, OomMessage) or error is None else parse_oom(str(error))
    if message is None and profile is None:
        raise NoOomFound("no out-of-memory error found in the input: paste torch's message (it starts "
                         "'CUDA out of memory' or 'DefaultCPUAllocator') or pass the log that holds it")
    work = _Work.of(message, model=model, batch=batch, loss_fn=loss_fn, recipe=recipe, batch_size=batch_size,
                    seq_len=seq_len, gpu=gpu, budget=budget, allow=allow, label=label, profile=profile, search=plan)
    found = diagnose_profile(profile, work.capacity) if profile is not None else None
    if found is not None and found.cause in ("leak", "eval_without_no_grad", "long_batch"):
        return _with_recipe_fixes(found, work)
    if work.model is not None:
        return work.diagnose(message, found)
    if message is not None:
        return _from_message(message, work, found)
    return found


def _from_message(message: OomMessage, work, found: Diagnosis | None) -> Diagnosis:
    """The message's own rules; a profile's category answer, or ``unknown``, when they say nothing."""
    cause, summary, fix = message_cause(message)
    if cause == "unknown" and found is not None:
        return found
    if cause == "unknown":
        summary += ("; pass the model and its flags (memfit doctor MODEL --batch-size ... --error LOG) or run the "
                    "script under the profiler (memfit doctor --budget SIZE -- python train.py)")
    return Diagnosis(cause, summary, message.to_dict(), (fix,) if fix else (), {"source": "message"}, work.notes)


def message_cause(message: OomMessage) -> tuple[str, str, Fix | None]:
    """(cause, summary, direct fix) from a message's figures alone: ``other_process``, ``fragmentation``
    or ``unknown``."""
    if message.requested is None or message.capacity is None:
        return "unknown", f"{message.kind} out of memory, without figures to tell why", None
    free = message.free if message.free is not None else max(message.capacity - (message.this_process or 0), 0)
    fragmented = message.reserved_unallocated or 0
    room = free  # what the request could get: the device's free memory, or less under a cap
    if message.allowed is not None and message.allocated is not None:
        room = min(room, max(message.allowed - message.allocated - fragmented, 0))
    lacked = max(message.requested - room, 0)
    floor = SHARE * message.capacity
    others = message.other_bytes
    if others >= max(lacked, floor) and others >= fragmented and free < message.requested:
        return "other_process", (f"other processes hold {format_size(others)} of the card: the "
                                 f"{format_size(message.requested)} request lacked {format_size(lacked)}"), \
            other_process_fix(message, fits=others + free >= message.requested)
    if fragmented >= max(lacked, floor):
        return "fragmentation", (f"{format_size(fragmented)} is reserved by PyTorch but unallocated "
                                 f"(fragmented), more than the {format_size(lacked)} the "
                                 f"{format_size(message.requested)} request lacked"), \
            fragmentation_fix(fragmented, fits=fragmented + room >= message.requested)
    cap = "" if message.allowed is None else f" under the process's cap of {format_size(message.allowed)}"
    return "unknown", (f"the {format_size(message.requested)} request found {format_size(room)} free{cap} of "
                       f"{format_size(message.capacity)}; the message alone does not say what holds the rest"), None


def fragmentation_fix(saves: int, fits: bool | None, command: str = "<your command>") -> Fix:
    return Fix("expandable_segments", saves, fits, 1.0, command=f"{ALLOC_CONF} {command}",
               why="segments that grow in place: the reserved-but-unallocated memory serves the request")


def other_process_fix(message: OomMessage, fits: bool | None) -> Fix:
    pids = ", ".join(str(pid) for pid, _ in message.other_processes) or "?"
    index = message.device.split(":")[-1] if ":" in message.device else "0"
    return Fix("free_other_processes", message.other_bytes, fits, 1.0,
               command=f"nvidia-smi --query-compute-apps=pid,used_memory --format=csv -i {index}  # stop {pids}, "
                       f"or run on a free card: CUDA_VISIBLE_DEVICES=<free index>",
               why=f"process(es) {pids} hold {format_size(message.other_bytes)} of the card")


# -- from a profile --------------------------------------------------------------------------------------

def diagnose_profile(data: dict, capacity: int | None = None) -> Diagnosis:
    """The cause from a memfit profile's ``to_dict()`` (``memfit profile --json``): ``leak`` when what the
    leaks added (bytes_per_step x steps) is at least ``PROFILE_SHARE`` of the live bytes at the OOM;
    ``eval_without_no_grad`` when a forward with grad whose activations no backward consumed is that large;
    ``long_batch`` when the step that ran out had ``LONG_FACTOR`` x the median step's tokens and the most;
    else by category at the OOM: ``model_states`` over ``capacity``, ``optimizer_temporaries`` in the
    optimizer phase, else ``activations``.

    ``capacity``: what the run could use (default the live bytes at the OOM). A profile without an OOM is
    read as one at its peak when the peak is over ``capacity``; otherwise ``NoOomFound``.
    """
    if not isinstance(data, dict):
        raise MemfitError(f"a profile is the JSON of memfit profile --json (a dict), got {type(data).__name__}")
    oom = _profile_oom(data, capacity)
    live = max(int(oom.get("live_bytes") or 0), 1)
    capacity = capacity or live
    figures = {"kind": "profile", "phase": oom.get("phase"), "step": oom.get("step"), "capacity": capacity,
               "requested": oom.get("requested_bytes"), "live_bytes": live, "by_category": oom.get("by_category") or {},
               "message": oom.get("message")}
    for rule in (_leak, _eval, _long):
        found = rule(data, oom, live, capacity)
        if found is not None:
            return Diagnosis(found[0], found[1], figures, found[2], {"source": "profile"})
    cause, summary = _by_category(figures["by_category"], oom.get("phase"), capacity)
    return Diagnosis(cause, summary, figures, (), {"source": "profile"})


def _profile_oom(data: dict, capacity: int | None) -> dict:
    oom = data.get("oom")
    if isinstance(oom, dict):
        return oom
    peak = int(data.get("peak_bytes") or 0)
    if capacity is None or peak <= capacity:
        raise NoOomFound("the profile has no out-of-memory error" + ("" if capacity is None else
                         f" and its peak {format_size(peak)} fits {format_size(capacity)}"))
    steps = data.get("step_peaks") or [peak]
    report = data.get("report") or data
    return {"phase": None, "step": max(range(len(steps)), key=steps.__getitem__), "live_bytes": peak,
            "by_category": report.get("by_category") or {}, "message": None}


def _leak(data, oom, live, capacity):
    leaks = [x for x in data.get("leaks") or [] if isinstance(x, dict)]
    grown = sum(int(x.get("bytes_per_step", 0)) * int(x.get("steps", 0)) for x in leaks)
    if not leaks or grown < PROFILE_SHARE * live:
        return None
    worst = max(leaks, key=lambda x: int(x.get("bytes_per_step", 0)) * int(x.get("steps", 0)))
    site, per = worst.get("site") or "?", int(worst.get("bytes_per_step", 0))
    fix = Fix("fix_leak", grown, live - grown + int(oom.get("requested_bytes") or 0) <= capacity, 1.0,
              command=f"{site}: keeps {format_size(per)} of {worst.get('category', 'tensors')} a step; store "
                      "loss.item() or tensor.detach() there, not the tensor with its graph",
              why=f"{len(leaks)} leak(s) added {format_size(grown)} over the steps")
    return "leak", (f"memory grows every step: {format_size(grown)} of the {format_size(live)} live at the OOM "
                    f"was added by leaks, the largest at {site} ({format_size(per)} a step)"), (fix,)


def _eval(data, oom, live, capacity):
    """Forwards with grad that completed in the step that ran out and whose activations no backward took
    (an evaluation loop keeping its outputs); the forward the OOM cut short counts only beside them (on
    its own it is any step's forward, or a long batch's)."""
    loose = [x for x in data.get("forwards_without_backward") or [] if isinstance(x, dict)]
    here = [x for x in loose if x.get("step") == oom.get("step")]
    cut = here[-1:] if here and oom.get("phase") == "forward" else []
    done = here[:len(here) - len(cut)]
    held = sum(int(x.get("bytes", 0)) for x in done + cut)
    if not done or held < PROFILE_SHARE * live:
        return None
    site = done[0].get("site") or "the evaluation loop"
    fix = Fix("no_grad", held, live - held + int(oom.get("requested_bytes") or 0) <= capacity, 1.0,
              command=f"{site}: wrap evaluation in `with torch.no_grad():` (or torch.inference_mode())",
              why=f"{len(done + cut)} forward(s) with grad enabled saved {format_size(held)} for a backward that "
                  "never came")
    return "eval_without_no_grad", (f"{len(done + cut)} forward(s) at {site} (step {int(oom.get('step') or 0) + 1}) "
                                    f"ran with grad enabled and saved {format_size(held)} of activations no backward "
                                    "consumed"), (fix,)


def _long(data, oom, live, capacity):
    """The step that ran out had ``LONG_FACTOR`` x the median step's tokens, and the most. The fix caps the
    length at that multiple of the median: it saves what the step held over the largest peak of the steps
    within the cap, and fits when that peak does."""
    tokens = {x.get("step"): int(x.get("tokens") or 0) for x in data.get("inputs") or [] if isinstance(x, dict)}
    step = oom.get("step")
    if len(tokens) < 3 or step not in tokens:
        return None
    median = statistics.median(tokens.values())
    if tokens[step] < LONG_FACTOR * median or tokens[step] < max(tokens.values()):
        return None
    cap = int(median * LONG_FACTOR)
    peaks = [int(x["peak_bytes"]) for x in data.get("steps") or [] if isinstance(x, dict)
             and x.get("peak_bytes") is not None and tokens.get(int(x.get("step", 0)) - 1, cap + 1) <= cap]
    usual = max(peaks, default=None)
    need = live + int(oom.get("requested_bytes") or 0)
    fix = Fix("cap_length", None if usual is None else max(need - usual, 0), None if usual is None else usual <= capacity,
              1.0, command=f"cap each step at about {cap:,} input elements ({LONG_FACTOR}x the median): truncate "
                           "(--seq-len), or batch by tokens, not rows (sort by length; memfit train --global-tokens)",
              why=f"step {step + 1} had {tokens[step]:,} input elements, {tokens[step] / max(median, 1):.1f}x the median")
    return "long_batch", (f"step {step + 1} had {tokens[step]:,} input elements against a median of {median:,.0f}: "
                          "the long batch, not the usual one, ran out"), (fix,)


def _by_category(by_category: dict, phase, capacity: int) -> tuple[str, str]:
    states = sum(int(by_category.get(k, 0)) for k in ("parameters", "gradients", "optimizer_state"))
    if states > capacity:
        return "model_states", (f"parameters, gradients and optimizer state hold {format_size(states)}, over the "
                                f"{format_size(capacity)} the run could use")
    if phase == "optimizer":
        return "optimizer_temporaries", f"the optimizer step ran out, with model states at {format_size(states)}"
    held = sum(int(by_category.get(k, 0)) for k in ("activations", "temporaries"))
    return "activations", (f"activations and temporaries held {format_size(held)} beside "
                           f"{format_size(states)} of model states when it ran out ({phase or 'forward/backward'})")


def _with_recipe_fixes(found: Diagnosis, work) -> Diagnosis:
    """A profile's direct fix first, then the plan for the model, when it is given."""
    if work.model is None:
        return Diagnosis(found.cause, found.summary, found.figures, found.fixes, found.evidence, work.notes)
    return work.extend(found)


# -- from the model: the failing step estimated, and each fix ---------------------------------------------

class _Work:
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
           profile, search) -> "_Work":
        from memfit.techniques.recipe import Recipe
        from memfit.units import parse_size

        notes = []
        recipe = Recipe.from_dict(recipe) if isinstance(recipe, dict) else recipe or Recipe()
        cuda = gpu is not None or (message is not None and message.kind.startswith("cuda"))
        target = _card(gpu, message, notes) if cuda and (model is not None or gpu is not None) else None
        capacity = parse_size(budget) if budget is not None else _room(message, target)
        if capacity is None and target is not None:
            capacity = target.memory_bytes
        if capacity is None and isinstance(profile, dict):
            capacity = (profile.get("oom") or {}).get("live_bytes") or profile.get("budget_bytes")
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
                   label=label or (model if isinstance(model, str) else "MODEL"), notes=notes, search=search)

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
        return 0 if self.target is None else self.target.cuda_context_bytes

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
                           f"{format_size(self.capacity)} left beside other processes' {format_size(message.other_bytes)}")
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
            fix = fragmentation_fix(max((base.reserved_bytes or 0) - base.peak_bytes, 0), True, self.command(self.recipe))
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
        cat, cap = base.by_category, format_size(self.capacity)
        states = base.model_state_bytes
        if states + self.context() > self.capacity:
            return "model_states", (f"parameters {format_size(cat.get('parameters', 0))}, gradients "
                                    f"{format_size(cat.get('gradients', 0))} and optimizer state "
                                    f"{format_size(cat.get('optimizer_state', 0))} need {format_size(states)} on "
                                    f"their own, over the {cap} the process could use")
        peaks = base.phase_peaks
        graph = max(peaks.get("forward", 0), peaks.get("backward", 0))
        if peaks.get("optimizer", 0) > graph and graph + self.context() <= self.capacity:
            return "optimizer_temporaries", (f"the optimizer step peaks at {format_size(peaks['optimizer'])}, over "
                                             f"the {cap} the process could use; forward and backward peak at "
                                             f"{format_size(graph)}")
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
               "activations": [("checkpointing", {"checkpointing": "blocks"}), ("bf16_mixed", {"precision": "bf16-mixed"}),
                               ("chunked_loss", {"chunked_loss": 8}), ("sdpa_attention", {"attention": "sdpa"})]
               # on the CPU the host is the device: offloading activations there frees nothing
               + ([("offload_activations", {"offload_activations": True})] if cuda else [])}.get(cause, [])
        allowed = {name.strip().lower() for name in (self.allow.split(",") if isinstance(self.allow, str) else self.allow)}
        math = [("adamw8bit", {"optimizer": "adamw8bit"}), ("paged_adamw8bit", {"optimizer": "paged_adamw8bit"}),
                ("lora", {"lora": "lora"}), ("qlora", {"lora": "qlora"}), ("bf16", {"precision": "bf16"})]
        if cause in RECIPE_CAUSES:
            out = out + [(name, change) for name, change in math if name in allowed]
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
                             why=recipe.describe()))
        return fixes

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

        parts = ["memfit", "estimate", str(self.label)]
        if self.batch_size:
            parts += ["--batch-size", str(self.batch_size)]
        if self.seq_len:
            parts += ["--seq-len", str(self.seq_len)]
        parts += ["--gpu", self.target.name] if self.target is not None else ["--device", "cpu"]
        parts += ["--budget", _size_arg(self.capacity)] + _flags(recipe)
        env = f"{ALLOC_CONF} " if getattr(report, "verdict", None) == EXPANDABLE else ""
        return env + " ".join(parts)


def _room(message: OomMessage | None, target) -> int | None:
    """What the process could use by the message: the device less the other processes, or its cap plus the
    CUDA context (torch's cap is on what it reserves; memfit's budget includes the context)."""
    if message is None or message.capacity is None:
        return None
    room = message.capacity - message.other_bytes
    if message.allowed is not None:
        room = min(room, message.allowed + (target.cuda_context_bytes if target is not None else 0))
    return room


def _card(gpu, message: OomMessage | None, notes: list):
    """The catalog GPU: the one named, else the one whose memory the message's capacity is (within 2 %)."""
    from memfit.estimator.estimate import DEFAULT_GPU
    from memfit.hardware.gpus import CATALOG, gpu as lookup

    if gpu is not None:
        return gpu if not isinstance(gpu, str) else lookup(gpu)
    capacity = message.capacity if message is not None else None
    cards = list(CATALOG.values())
    if capacity:
        best = min(cards, key=lambda c: abs(c.memory_bytes - capacity))
        if abs(best.memory_bytes - capacity) <= 0.02 * capacity:
            notes.append(f"GPU taken as {best.name}: its memory is nearest the message's {format_size(capacity)} "
                         "capacity (pass --gpu to name yours)")
            return best
    notes.append(f"no catalog GPU has the message's capacity: {DEFAULT_GPU} semantics under it (pass --gpu)")
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
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
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
