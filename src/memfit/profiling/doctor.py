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
mps_limit              on a Mac, the request would take the process past MPS's high watermark (the message)
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
change to the failing recipe: checkpointing, bf16-mixed, chunked loss, SDPA, activation offload (CUDA), a
smaller micro-batch with accumulation keeping the global batch (activations); stepping in backward
(model states); a for-loop or chunked optimizer step, stepping in backward (optimizer temporaries); 8-bit
states, LoRA, QLoRA, pure bf16 only when ``allow`` names them (exact by default); plus ``memfit plan``'s
answer for the capacity. Each is a full estimate: ``saves_bytes`` is the failing step's device bytes
(what its estimate held, plus what it missed) less the candidate's, ``fits`` whether it fits (on a GPU
the allocator's verdict: a fix that fits only with expandable segments says so in its command), and
``speed_cost`` its step time over the failing one's by the planner's cost model (``planner/cost.py``;
only fixes that fit are timed; None where the model does not time the technique changed, such as the
chunked step). On CPU semantics the cost model first measures this CPU (``Speed.host``: seconds, once per
process). For the other causes the first fix is the direct one (the environment variable, freeing the
other process, the leak's file:line, ``torch.no_grad()``, capping the length), then ``memfit plan``'s
recipe when the model is given.

Ranking: fixes that fit first, then the lower speed cost (unknown last), then the more bytes saved;
for a cause outside the recipe its direct fix stays first.

``Diagnosis.exit_code`` is what ``memfit doctor`` exits with: 0 diagnosed and a fix that fits found,
3 diagnosed but no fix fits (or the cause is unknown), 4 no out-of-memory in the input (``NoOomFound``);
bad input is a ``MemfitError`` (exit 2). ``run_step`` runs real CPU steps under a virtual budget: how a
scenario runs out, and how a fix is checked for real.

Known limitations:
- one message names one allocation, not the step: without the model or a profile only ``fragmentation``
  and ``other_process`` can be told; a leak, a grad-enabled evaluation or a long batch need a profile;
- figures read from a message are within a hundredth of their unit; the GPU is guessed from the capacity
  when not named (the nearest catalog card within 2 %);
- fixes are single changes and the plan, not every combination; optimizer offload is not offered (it
  runs on a real GPU only, so no estimate checks it);
- an evaluation is told by forwards that completed without a backward in the step that ran out.
"""

from __future__ import annotations

import statistics

from memfit.errors import MemfitError
from memfit.profiling.findings import (CAUSES, EXIT_FITS, EXIT_NO_FIX, EXIT_NO_OOM, LONG_FACTOR, PROFILE_SHARE,
                                       Diagnosis, Fix, NoOomFound, message_cause)
from memfit.profiling.fixes import Failing, run_step
from memfit.profiling.oom_text import OomMessage, parse_oom
from memfit.units import format_size

__all__ = ["diagnose", "diagnose_profile", "run_step", "Diagnosis", "Fix", "NoOomFound", "CAUSES", "EXIT_FITS",
           "EXIT_NO_FIX", "EXIT_NO_OOM"]

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
                         "'CUDA out of memory', 'HIP out of memory', 'MPS backend out of memory' or "
                         "'DefaultCPUAllocator') or pass the log that holds it")
    work = Failing.of(message, model=model, batch=batch, loss_fn=loss_fn, recipe=recipe, batch_size=batch_size,
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


def diagnose_profile(data: dict, capacity: int | None = None) -> Diagnosis:
    """The cause from a memfit profile's ``to_dict()`` (``memfit profile --json``): ``leak`` when what the
    leaks added (bytes_per_step x steps) is at least ``PROFILE_SHARE`` of the live bytes at the OOM;
    ``eval_without_no_grad`` when a forward with grad whose activations no backward consumed is that large;
    ``long_batch`` when the step that ran out had ``LONG_FACTOR`` x the median step's tokens and the most;
    else by category at the OOM: ``model_states`` over ``capacity``, ``optimizer_temporaries`` in the
    optimizer phase, else ``activations``.

    ``capacity``: what the run could use (default: the virtual budget it ran under, ``settings.budget``, else
    the live bytes at the OOM). A profile without an OOM is read as one at its peak when the peak is over
    ``capacity``; otherwise ``NoOomFound``.
    """
    if not isinstance(data, dict):
        raise MemfitError(f"a profile is the JSON of memfit profile --json (a dict), got {type(data).__name__}")
    oom = _profile_oom(data, capacity)
    if oom.get("requested_bytes") is None and oom.get("message"):  # the message says what the request was
        said = parse_oom(str(oom["message"]))
        oom = dict(oom, requested_bytes=said.requested if said is not None else None)
    live = max(int(oom.get("live_bytes") or 0), 1)
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
    capacity = capacity or settings.get("budget") or live
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
    saves, fits = (None, None) if usual is None else (max(need - usual, 0), usual <= capacity)
    fix = Fix("cap_length", saves, fits, 1.0,
              command=f"cap each step at about {cap:,} input elements ({LONG_FACTOR}x the median): truncate "
                      "(--seq-len), or batch by tokens, not rows (sort by length; memfit train --global-tokens)",
              why=f"step {step + 1} had {tokens[step]:,} input elements, "
                  f"{tokens[step] / max(median, 1):.1f}x the median")
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
