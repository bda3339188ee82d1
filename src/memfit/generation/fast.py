"""The generation fast path: three short traces of a shallow copy stand for a long generation of a deep model.

A full estimate traces every forward of ``generate``: ~0.4 s per token for a 1B model, hours for
thousands of tokens of a 70B one. But the peak of a greedy generation is in one of two places:

* the **prefill** and the first decode step (where a sliding-window layer trims the prompt's cache): the
  weights, the cache the prompt fills, one forward's activations over the prompt, its logits. Traced as
  they are, at the true prompt length, the trace stopped as decode step 2 begins (so a static cache is
  allocated at its true length, ``prompt + new``);
* the **last decode step**: the weights, the cache at ``prompt + new - 1`` positions, one token's
  forward and the ``torch.cat`` copy of one layer's keys or values, the grown ids and mask. All of it is
  a function of the cache's length, never of how the cache got there, but for the tensors a generation
  keeps of its prompt (the caller's ids and mask, ``generate``'s own copy): so it is traced as the last
  step of 3 and of 4 new tokens from the prompts that end at the same length, and the difference, a
  line in the prompt's length, is followed back to the true prompt (the peak and each category).

The steps between are not traced: the cache only grows, so they are below the last one. Each trace runs
on the depth fast path's shallow copy (``estimator/depth.py``: first, second, middle and last blocks,
layer kinds kept where the deep model has them), its allocation log written out at full depth
(``accounting/synth.py``) and replayed. The peak is the larger of the two places; ``step_peaks`` are
the traced forwards' only. ``tests/test_generate_fast.py`` and ``bench/generation/generate_fast.py`` check it
against full traces: byte-exact but for depth.py's 8-byte set-up tensor per cache layer of the
sliding-window and static caches.

Known limitations: an encoder-decoder model (its cross-attention cache is the prompt's, so the last
step's prompt must be the true one) and a quantised cache (which positions are quantised depends on
the cache's history: its residual buffer) are not exact this way and are traced in full, with a note.
The report's timeline and modules are those of the trace that peaks (none where the peak is the last
step: that trace's own peak is its longer prefill); kernel scratch of the last-step traces is probed
for their last step only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.accounting.ledger import MARK, SPIKE
from memfit.accounting.replay import replay
from memfit.accounting.scratch import measure_scratch
from memfit.accounting.synth import synthesise
from memfit.errors import MemfitError
from memfit.estimator.depth import plan_copy
from memfit.estimator.fake import build_fake, fake_copy
from memfit.generation.device import cuda_fields
from memfit.generation.full import as_real, check_generates, generation_ledger, register, semantics, traced
from memfit.generation.run import Request, prompt_batch, vocab_size
from memfit.generation.values import LIMIT, KnownValues
from memfit.generation.weights import DTYPES, Outliers, quantize_weights
from memfit.hardware.cpu_kernels import CpuKernels
from memfit.estimator.trace import numel
from memfit.report.report import Report

__all__ = ["estimate_fast", "choose_fast", "fast_refusal", "FAST_FROM"]

#: ``fast=None`` takes the fast path from this many block forwards of the full trace ((new_tokens + 1) x depth):
#: below it the full trace takes seconds.
FAST_FROM = 256


class _Stop(Exception):
    """Raised as a decode step begins: the trace has every forward it needs."""


@dataclasses.dataclass
class _Forward:
    """One traced forward, written out at full depth and replayed."""
    peak: int  # bytes at the forward's peak, full depth
    by_category: dict  # at that peak
    modules: list  # activations and temporaries by module at that peak (empty: not the trace's own peak)
    timeline: list  # the whole trace's
    stacked: dict
    scratch: int  # kernel scratch at the peak
    parameters: int  # logical weights of the deep model
    notes: dict  # counts: unprobed op calls, unknown scalar reads, frees unmatched at full depth
    phase_peaks: dict  # prefill / decode -> peak over the traced forwards of that phase
    step_peaks: list  # the peak of each traced forward, in order
    log: object = None  # the allocation log, at full depth (what the CUDA allocator replays)
    log_peak: int = 0  # its peak over every traced forward


def fast_refusal(source, request: Request) -> str | None:
    """Why the fast path would not be exact for this generation (None: it is)."""
    if source.config is not None and getattr(source.config, "is_encoder_decoder", False):
        return ("an encoder-decoder model's cross-attention cache is the prompt's: the last decode step cannot be "
                "traced from a longer prompt")
    if request.cache.startswith("quantized"):
        return "a quantised cache's state depends on its history (its residual buffer): it cannot be traced short"
    return None


def estimate_fast(source, request: Request, precision: str, weights: str, progress=None, gpu=None,
                  budget: int | None = None) -> Report:
    """The prefill and the last decode step of ``request`` (see the module), at the deep model's depth."""
    copy = plan_copy(source) if source.module is None else None
    shallow = source.shallow(copy.blocks) if copy is not None else source
    tick = _ticker(progress)
    if request.new_tokens <= 4:  # as short as the traces below: trace it whole
        prefill, last = _forward(shallow, copy, request, precision, weights, upto=None, last=None, gpu=gpu), None
    else:
        prefill = _forward(shallow, copy, request, precision, weights, upto=2, last=None, gpu=gpu)
        tick(1)
        last = _last_step(shallow, copy, request, precision, weights, gpu)
    tick(2)
    top = prefill if last is None or prefill.peak >= last.peak else last
    depth = source.depth
    traced = (f"traced {len(copy.blocks)} of {depth} blocks, written out at all {depth}; " if copy is not None
              else "")
    notes = [f"generate: greedy, exactly {request.new_tokens} new tokens (eos disabled), one beam",
             f"fast path: {traced}the prefill and first decode step at {request.prompt_len} prompt tokens, and the "
             f"last decode step (a cache of {request.prompt_len + request.new_tokens - 1} positions) as the last of 3 "
             f"and of 4 new tokens, followed back to the true prompt; fast=False or --full traces every step"]
    text = source.config.get_text_config(decoder=True) if source.config is not None else None
    if getattr(text, "num_experts_per_tok", None):
        notes.append(f"mixture of experts: {source.moe_routing} routing assumed (moe_routing=); it changes only CPU "
                     "bf16 kernel scratch")
    phase_peaks = {"prefill": prefill.phase_peaks.get("prefill", 0),
                   "decode": max(prefill.phase_peaks.get("decode", 0), last.peak if last is not None else 0)}
    cuda = {}
    if gpu is not None:
        cuda, more = cuda_fields(prefill.log, gpu, budget, above=top.peak - prefill.log_peak)
        notes += more
    return Report(
        peak_bytes=cuda.pop("peak_bytes", top.peak),
        by_category=top.by_category,
        phase_peaks=phase_peaks,
        step_peaks=prefill.step_peaks + ([last.peak] if last is not None else []),
        modules=top.modules,
        timeline=top.timeline,
        stacked=top.stacked,
        device="cpu" if gpu is None else "cuda",
        method="depth" if copy is not None else "fast",
        modelled_bytes=top.scratch,
        unprobed_ops=sum(f.notes["unprobed"] for f in ([prefill] + ([last] if last is not None else []))),
        parameters=top.parameters,
        trainable=0,
        settings={"workload": "generate", "precision": precision, "weights": weights, "cache": request.cache,
                  "prompt_len": request.prompt_len, "new_tokens": request.new_tokens,
                  "batch_size": request.batch_size, "padding": request.padding,
                  "logits_to_keep": request.logits_to_keep, "steps": request.new_tokens,
                  "batch_shapes": [[request.batch_size, request.prompt_len]] * 2,
                  "traced_depths": [len(copy.blocks)] if copy is not None else [depth],
                  **({"depth": depth} if depth else {})},
        notes=notes + _counted([prefill] + ([last] if last is not None else [])) + list(source.notes),
        **cuda,
    )


def _last_step(source, copy, request: Request, precision: str, weights: str, gpu=None) -> _Forward:
    """The last decode step of ``request``: a cache of ``prompt + new - 1`` positions, traced as the last step
    of 3 and of 4 new tokens from the prompts that end there. The tensors a generation keeps of its prompt
    (the caller's ids and mask, ``generate``'s own copies) are the only difference between the two: a line
    in the prompt's length, followed back to the true prompt for the peak and each category."""
    end = request.prompt_len + request.new_tokens - 1
    a, b = (_forward(source, copy, dataclasses.replace(request, prompt_len=end - k + 1, new_tokens=k), precision,
                     weights, upto=None, last=k - 1, gpu=gpu) for k in (3, 4))
    back = request.new_tokens - 3  # prompt tokens from trace a's to the true one

    def line(x: int, y: int) -> int:
        return x - (x - y) * back

    a.peak = line(a.peak, b.peak)
    a.by_category = {c: line(v, b.by_category.get(c, 0)) for c, v in a.by_category.items()}
    return a


def _forward(source, copy, request: Request, precision: str, weights: str, *, upto: int | None,
             last: int | None, gpu=None) -> _Forward:
    """Trace ``request`` on ``source`` up to decode step ``upto`` (None: all of it), its log written at the deep
    depth and replayed; the peak of its forward ``last`` (None: of everything traced)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    dtype = DTYPES[precision]
    model = fake_copy(source.module, mode, dtype) if source.module is not None else \
        build_fake(source.build, mode, torch.device("cpu"), dtype)
    check_generates(model, source.name)
    extra = quantize_weights(model, weights, dtype)
    top_k = getattr(model.config.get_text_config(decoder=True), "num_experts_per_tok", None)
    reads = KnownValues(max(LIMIT, 4 * request.batch_size * request.prompt_len),
                        kernels=CpuKernels(source.moe_routing, top_k))  # in the mode: one mode less an op
    prompt = {}
    for name, value in prompt_batch(request, vocab_size(model.config)).items():
        prompt[name] = mode.from_tensor(value)
        reads.known(prompt[name], value)
    ledger = generation_ledger(model, weights, gpu)
    if upto is not None:
        ledger.on_phase = _stop_at(ledger, upto)
    register(ledger, model, extra, prompt)
    with as_real(), mode, Outliers(), reads, semantics(gpu):
        try:
            traced(model, prompt, request, ledger, source.name)
        except _Stop:
            pass
        scratch, unprobed = _scratch(ledger, last)
    log = ledger if copy is None else synthesise(ledger, depth=copy.units * copy.unit, unit=copy.unit)
    result = replay(log, scratch)
    steps = sorted((step, ph) for (step, ph) in result.phase_peaks if ph in ("prefill", "decode"))
    wanted = [k for k in steps if last is None or k[0] == last]
    key = max(wanted, key=result.phase_peaks.get)
    peak = result.phase_peaks[key]
    notes = {"unprobed": unprobed, "reads": reads.reads}
    if copy is not None and log.unmatched:
        notes["unmatched"] = log.unmatched
    # the forward asked for may not hold the trace's peak (the decode trace's prefill of a longer prompt):
    # its categories then are those at its own peak, and the modules and scratch are left out
    own = result.phase_peaks[key] == result.peak_bytes
    by_category = dict(result.by_category if own else result.phase_categories[key])
    phase_peaks = {}
    for step, ph in steps:
        phase_peaks[ph] = max(phase_peaks.get(ph, 0), result.phase_peaks[(step, ph)])
    return _Forward(peak, by_category, result.modules if own else [], result.timeline, result.stacked,
                    result.scratch_at_peak if own else 0, _parameters(ledger, log, copy), notes,
                    phase_peaks, [result.phase_peaks[k] for k in steps], log, result.peak_bytes)


def _counted(forwards: list) -> list[str]:
    """The notes of the traces' counts, summed over them."""
    total = {key: sum(f.notes.get(key, 0) for f in forwards) for key in ("unprobed", "reads", "unmatched")}
    notes = []
    if total["unprobed"]:
        notes.append(f"{total['unprobed']} large op call(s) were not replayed for kernel scratch; their scratch is not "
                     "counted")
    if total["reads"]:
        notes.append(f"{total['reads']} scalar read(s) of values the fake run cannot know were answered with a default")
    if total["unmatched"]:
        notes.append(f"{total['unmatched']} free(s) of the shallow traces had no counterpart at full depth")
    return notes


def _scratch(ledger, last: int | None) -> tuple[list[int], int]:
    """``measure_scratch`` of the sites of decode step ``last`` onwards (None: of all): the prefill of a last-step
    trace's longer prompt is not used, and probing its attention for real would cost seconds per call."""
    if last is None:
        return measure_scratch(ledger)
    keep, now = [], None
    for kind, index in ledger.events:
        if kind == MARK:
            now = ledger.marks[index]
        elif kind == SPIKE and now is not None and now[0] == "decode" and now[1] >= last:
            keep.append(index)
    some, unprobed = measure_scratch(_Sites(ledger, [ledger.sites[i] for i in keep]))
    scratch = [0] * len(ledger.sites)
    for index, value in zip(keep, some):
        scratch[index] = value
    return scratch, unprobed


@dataclasses.dataclass
class _Sites:
    """A ledger's records with some of its probe sites: what ``measure_scratch`` reads."""
    ledger: object
    sites: list

    @property
    def records(self):
        return self.ledger.records


def _parameters(ledger, log, copy) -> int:
    if copy is None:
        return sum(numel(p) for p in ledger.model.parameters())
    root = ledger.root
    total = 0
    for name, param in ledger.model.named_parameters():
        owner = f"{root}.{name.rsplit('.', 1)[0]}" if "." in name else root
        total += log.copies(owner) * numel(param)
    return total


def _prompt_bytes(request: Request) -> int:
    """Bytes of the caller's prompt tensors (ids and mask, int64), which live through the whole generation."""
    return 2 * request.batch_size * request.prompt_len * torch.empty((), dtype=torch.long).element_size()


def _stop_at(ledger, step: int):
    def on_phase():
        if ledger.phase == "decode" and ledger.step >= step:
            raise _Stop
    return on_phase


def _ticker(progress):
    if progress is None:
        return lambda done: None
    progress(0, 3)
    return lambda done: progress(done, 3)


def choose_fast(fast: bool | None, source, request: Request) -> tuple[bool, str | None]:
    """Whether ``estimate_generate`` takes the fast path, and the note to add when it does not although asked
    (``fast=True`` where it is not exact is refused; ``fast=None`` falls back with the reason)."""
    if fast is False:
        return False, None
    refusal = fast_refusal(source, request)
    if fast is True and refusal is not None:
        raise MemfitError(f"fast=True and this generation conflict: {refusal}; leave fast unset or use fast=False")
    if fast is None:
        if (request.new_tokens + 1) * (source.depth or 1) <= FAST_FROM:
            return False, None
        if refusal is not None:
            return False, f"traced every step: the fast path is not exact here ({refusal})"
    return True, None
