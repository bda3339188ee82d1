"""An optimizer step that an out-of-memory error cannot leave half applied.

torch's foreach and for-loop steps write parameters and state in place and allocate temporaries
between those writes (AdamW: ``lerp_`` and ``addcmul_`` on the moments, then ``_foreach_sqrt``
allocates): an OOM at that allocation leaves some moments updated and their parameters not, and
retrying the step applies the moment update twice. ``SafeStep`` steps the parameters in chunks: the
parameters whose gradient is hidden (``grad = None``) are skipped by every per-parameter torch
optimizer, so ``optimizer.step()`` updates one chunk at a time. Before a chunk steps, its parameters
and state are copied aside; an OOM while it steps puts the copies back (assignment and ``copy_``,
which allocate nothing), so every parameter is either fully updated or untouched. The chunk is then
halved and stepping goes on from it; chunks already stepped stay stepped, and a second call after an
error that escaped goes on from where the first stopped, so no parameter is ever stepped twice.

Memory: a chunk of about 1/k of the parameter bytes holds its copy (parameter and state: AdamW 3x
the chunk's bytes) and only its own step temporaries. With many even parameters that is below one
foreach step over everything (k = 8, estimated: the zoo Llama's optimizer phase −1.5%, GPT's −6%);
where one weight is most of the model its chunk cannot be split and the copies raise the step's
peak (the zoo MLP: +43%). Cost: k optimizer launches and the copies.

Works for optimizers whose update of a parameter reads only that parameter's gradient and state
(every ``torch.optim`` optimizer but LBFGS, bitsandbytes' and torchao's). Why by hand: torch has no
transactional step, and none of the trainers we measured against (HF Trainer, Lightning, Composer)
recovers from an OOM inside the optimizer step.

As a technique, ``Recipe(safe_step=k)``: ``apply``'s step runs the optimizer through
``SafeStep(optimizer, k)``, so ``estimate`` traces the chunked step (its copies and each chunk's
temporaries) exactly as ``memfit train`` runs it (``train`` sets ``safe_step=8`` unless the recipe
says otherwise). Not searched by ``plan`` (its copies can raise the step's peak, above); ``train``
sizes its micro-batches by estimates of the recipe with it (``training/predict.py``).

Does not combine with: fp16-mixed (the GradScaler steps the optimizer itself and may skip the
step), optimizer_in_backward (no optimizer step left), offload_optimizer, and the 8-bit / 4-bit
optimizers (bitsandbytes' and torchao's states are not rolled back by a copy).
"""

from __future__ import annotations

import torch

from memfit.errors import MemfitError, shown
from memfit.techniques.spec import Field, Technique

__all__ = ["SafeStep", "TECHNIQUE"]

#: what ``memfit train`` uses when the recipe sets nothing: 8 chunks hold about 1/8 of the
#: parameters' copies and temporaries at a time (AdamW fp32: the step's peak < 0.7x foreach's)
TRAIN_CHUNKS = 8


def _params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _split(params: list[torch.Tensor], chunks: int) -> list[list[torch.Tensor]]:
    """Contiguous runs of about equal bytes."""
    total = sum(p.numel() * p.element_size() for p in params) or 1
    out, current, done = [], [], 0
    for p in params:
        current.append(p)
        done += p.numel() * p.element_size()
        if done * chunks >= total * (len(out) + 1) and len(out) < chunks - 1:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class SafeStep:
    """``SafeStep(optimizer, chunks=8)()`` steps ``optimizer`` as ``optimizer.step()`` would, chunk by chunk.

    ``pending`` is what an escaped error left to step; the next call steps it (and nothing else).
    ``splits`` counts chunks halved after an OOM.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: int = 8):
        if chunks < 1:
            raise MemfitError(f"chunks must be at least 1, got {chunks}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MemfitError("LBFGS's update reads every parameter at once: it cannot step in chunks; use SafeStep "
                              "with a per-parameter optimizer")
        self.optimizer, self.chunks = optimizer, chunks
        self.pending: list[list[torch.Tensor]] = []
        self.splits = 0

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.pending:
            self.pending = _split(_params(self.optimizer), self.chunks)
        while self.pending:
            chunk = self.pending[0]
            try:
                self._step(chunk)
            except torch.OutOfMemoryError:
                if len(chunk) == 1:
                    raise  # nothing smaller to try: the caller frees memory and calls again
                half = len(chunk) // 2
                self.pending[0:1] = [chunk[:half], chunk[half:]]
                self.splits += 1
                continue
            self.pending.pop(0)

    def _step(self, chunk: list[torch.Tensor]) -> None:
        opt = self.optimizer
        inside = {id(p) for p in chunk}
        # Copied aside first: an OOM here has changed nothing.
        saved = [(p, p.detach().clone(), {k: _clone(v) for k, v in opt.state[p].items()} if p in opt.state else None)
                 for p in chunk]
        hidden = [(p, p.grad) for p in _params(opt) if id(p) not in inside]
        try:
            for p, _ in hidden:
                p.grad = None
            opt.step()
        except torch.OutOfMemoryError:
            for p, weights, state in saved:
                p.copy_(weights)
                if state is None:
                    opt.state.pop(p, None)
                else:
                    opt.state[p] = state
            raise
        finally:
            for p, grad in hidden:
                p.grad = grad


def _check(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096):
        raise MemfitError(f"safe_step must be a number of chunks from 1 to 4096 (8: memfit train's default), "
                          f"got {shown(value)}")


def _apply(build) -> None:
    chunks = build.recipe.safe_step
    if chunks is not None:
        build.wrap_step = lambda optimizer: SafeStep(optimizer, chunks)


def _conflicts(r):
    if r.safe_step is None:
        return
    if r.precision == "fp16-mixed":
        yield ("safe_step and fp16-mixed conflict: the GradScaler steps the optimizer itself (and may skip the "
               "step); use bf16-mixed, or drop safe_step")
    if r.optimizer_in_backward:
        yield "safe_step and optimizer_in_backward conflict: no optimizer step is left to chunk; drop one"
    if r.offload_optimizer:
        yield "safe_step and offload_optimizer conflict: the offloaded step runs on the CPU; drop one"
    if isinstance(r.optimizer, str) and ("8bit" in r.optimizer or "4bit" in r.optimizer or "fp8" in r.optimizer):
        yield (f"safe_step and optimizer={r.optimizer} conflict: a copy does not roll its quantised state back; "
               "use a torch optimizer (adamw, adam, sgd, adafactor) or drop safe_step")


TECHNIQUE = Technique(
    name="safe_step",
    fields=(Field("safe_step", None, "step the optimizer in this many chunks, each rolled back on out-of-memory "
                  "(memfit train uses 8); lowers the step's peak", slot=67, kind="optional-count", check=_check),),
    order=68, apply=_apply, conflicts=_conflicts, trace="none")
