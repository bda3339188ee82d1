"""Micro-batch shapes by their predicted peak: how many rows of a length fit the budget, from
memfit's own estimate of that shape.

``train`` cuts each global batch into micro-batches with ``fits(rows, length)``
(``batching.micro_batches``). With a budget, ``ShapeBudget.fits`` answers it from
``memfit.estimate`` of exactly that micro-batch shape under the run's recipe: the model (made
fake, so nothing real is allocated); a batch of ``rows`` padded rows, one of them ragged as real
data is so the attention mask is built (with ``packed``, rows of two documents each); two such
micro-batches a step, so the gradients of the first are live through the second's forward; and
the step's optimizer, ``safe_step`` included. A shape fits when its peak is within the budget: on
the CPU the allocator's peak (``peak_bytes``, the figure ``VirtualBudget`` caps); on CUDA when the
verdict of the estimate made with the budget says it fits (``estimator/verdict.py``: the caching
allocator replayed under the limit ``train`` sets, ``set_per_process_memory_fraction`` of the budget
less the CUDA context, freeing its cache and retrying as torch does; expandable segments count where
``PYTORCH_CUDA_ALLOC_CONF`` has them), the peak then being ``device_bytes`` (reserved + context), as
``plan`` decides. The uncapped reserved peak would call a shape out that the allocator runs by
releasing cached blocks (a planned 2-row micro-batch on an H200 was cut to 1 that way).

Lengths are padded up to buckets, multiples of ``step`` tokens (1/16 of the longest example
rounded up to 8, at least 32; the longest itself is the last bucket). A micro-batch is collated to
its bucket, so what was estimated is the shape that runs, and a run estimates at most 16 lengths.
For a length, the largest row count that fits is searched by estimates: a first guess from one and
two rows of the first bucket searched (the bytes a row adds, scaled to the bucket's tokens), then
up or down from it until the answer is bracketed (typically two estimates: the count fits, one
more does not). Answers are monotone (a longer bucket never takes more rows); estimates are cached
per (rows, bucket), and kept in a file (``store``: ``train`` passes ``OUT_DIR/estimates.json``) under a key
of the model (config, parameter shapes, versions), recipe, budget, card and shapes, so a resumed or
repeated run reads them back instead of estimating.

Cost: about a second an estimate on a small model, two to four per bucket seen, once per run (and
key). Estimates run with the budget's dispatch mode set aside, so
their fake tensors are not counted.

Why by hand: no trainer sizes micro-batches from a prediction (Composer halves after an OOM,
Lightning's finder and Hugging Face's ``auto_find_batch_size`` search by crashing).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memfit.errors import MemfitError
from memfit.models.lengths import direct, shape_batch
from memfit.training.data import collate

__all__ = ["ShapeBudget", "bucket_step", "bucket_length", "meta_copy", "model_identity"]

BUCKETS = 16  # lengths per run that are estimated at most
MIN_STEP = 32  # tokens: padding this many costs next to nothing, and short data needs fewer estimates
#: how a CUDA shape is judged (part of a stored estimate's key: another way makes the stored peaks stale)
VERDICT = "device_bytes under the budget's limit"


def bucket_step(longest: int) -> int:
    """Tokens per bucket for data whose longest example has ``longest`` tokens."""
    return max(MIN_STEP, math.ceil(longest / BUCKETS / 8) * 8)


def bucket_length(length: int, step: int, longest: int) -> int:
    """The padded length of a micro-batch whose longest row has ``length`` tokens: the next multiple
    of ``step``, never past ``longest``."""
    return min(longest, max(step, math.ceil(length / step) * step))


def model_identity(model) -> str:
    """What a stored estimate of ``model`` depends on: its config where it has one, its parameters' and
    buffers' names, shapes and dtypes (a LoRA or a changed layer is another model), and the versions."""
    import torch

    config = getattr(model, "config", None)
    parts = [config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else type(model).__qualname__,
             torch.__version__]
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        parts.append(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}")
    try:
        from importlib import metadata

        parts.append(metadata.version("memfit"))
    except Exception:  # noqa: BLE001 - a source tree: its code is the version
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _key(identity: str, recipe, budget: int, gpu, longest: int, max_rows: int, pad_id: int, packed: bool, parts: int,
         loss_fn, uniform: bool = False, expandable: bool = False) -> str:
    gpu_name = getattr(gpu, "name", gpu)
    body = json.dumps([identity, recipe.to_dict(), budget, gpu_name, longest, max_rows, pad_id, packed, parts,
                       loss_fn is not None, VERDICT] + ([True] if uniform else []) + (["expandable"] if expandable else []),
                      sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def _device_peak(report, budget: int, expandable: bool) -> int:
    """On CUDA, the peak a shape is judged by: ``device_bytes`` (reserved under the budget's limit + context) when
    the verdict says the step fits (with expandable segments only where the run has them), else more than
    the budget by what the allocator would miss."""
    from memfit.report.report import EXPANDABLE, FITS

    if report.verdict == FITS or (expandable and report.verdict == EXPANDABLE):
        return min(int(report.device_bytes), budget)  # with expandable segments torch may pass by part of a page
    return budget + max(1, int(report.missing_bytes or 0))


def meta_copy(model):
    """``model`` with every parameter and buffer on the meta device: what the estimates build from
    (``apply`` then changes the real model in place: LoRA, checkpointing wrappers)."""
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class ShapeBudget:
    """``fits(rows, length)`` for micro-batches of ``model`` under ``recipe`` within ``budget`` bytes.

    gpu        on CUDA, the catalog GPU whose semantics the estimates follow (``memfit.estimate``'s
               ``gpu``); None on the CPU
    max_rows   the most rows a micro-batch can have (the global batch's)
    """

    def __init__(self, model, recipe, budget: int, *, longest: int, max_rows: int, gpu=None, pad_id: int = 0,
                 loss_fn=None, packed: bool = False, store=None, identity: str = "", uniform: bool = False):
        self.model, self.budget, self.gpu, self.pad_id, self.loss_fn = model, int(budget), gpu, pad_id, loss_fn
        self.step = bucket_step(longest)
        self.longest = int(longest)  # the last bucket: never past the data's (or model's) longest
        self.max_rows = max(1, int(max_rows))
        # two micro-batches a step (the second's forward runs with the first's gradients live),
        # one where the optimizer steps in backward (nothing accumulates)
        self.parts = 1 if recipe.optimizer_in_backward else 2
        self.recipe, self.packed = recipe, packed
        # on CUDA, whether the allocator runs with expandable segments (use_alloc_conf sets them for a plan)
        self.expandable = gpu is not None and "expandable_segments:true" in \
            os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        # every row of the data is ``longest`` tokens (a token file cut into rows): no micro-batch has padding,
        # so none is estimated (a padded one carries an attention mask the run's batches do not)
        self.uniform = bool(uniform)
        self._peaks: dict[tuple[int, int], int] = {}
        self._rows: dict[int, int] = {}
        self._line = None  # (bucket, fixed bytes, bytes a row adds) of the first bucket searched
        self.estimates = 0
        self.seconds = 0.0  # spent estimating (the cut's own arithmetic is not an estimate)
        # estimates kept in a file (the run's out_dir), so a resumed or repeated run starts without them
        self.store = None if store is None else Path(store)
        self.key = _key(identity, recipe, self.budget, gpu, self.longest, self.max_rows, pad_id, packed, self.parts,
                        loss_fn, self.uniform, self.expandable)
        self.reused = self._load()

    def bucket(self, length: int) -> int:
        """The padded length a micro-batch whose longest row is ``length`` is collated to."""
        return bucket_length(length, self.step, self.longest)

    def peak(self, rows: int, length: int) -> int:
        """The predicted peak (bytes the budget caps) of ``rows`` rows of ``length``'s bucket."""
        key = (int(rows), self.bucket(length))
        if key not in self._peaks:
            self._peaks[key] = self._estimate(*key)
        return self._peaks[key]

    def _estimate(self, rows: int, length: int) -> int:
        from memfit.estimator.estimate import estimate
        from memfit.estimator.inputs import Hardware

        began = time.perf_counter()
        if self.packed:  # rows of two documents, as estimate_micro_batch(packed=True) makes them
            batch = shape_batch(direct(rows, length, True, True), self.parts)
        else:
            sizes = [length] * rows if self.uniform or length <= 1 else [length] + [length - 1] * (rows - 1)
            examples = [{"input_ids": torch.zeros(n, dtype=torch.long)} for n in sizes]
            micro = collate(examples, self.pad_id, length=length)
            batch = {k: torch.cat([v] * self.parts) for k, v in micro.items()}
        recipe = self.recipe.replace(micro_batch_size=rows, grad_accum_steps=self.parts)
        with _disable_current_modes():  # a VirtualBudget around the caller must not count fake tensors
            where = Hardware(gpu=self.gpu, device="cpu" if self.gpu is None else "cuda",
                             budget=None if self.gpu is None else self.budget)
            report = estimate(self.model, batch=batch, recipe=recipe, loss_fn=self.loss_fn, hardware=where, fast=False)
        self.estimates += 1
        self.seconds += time.perf_counter() - began
        peak = report.peak_bytes if self.gpu is None else _device_peak(report, self.budget, self.expandable)
        self._save((rows, length), peak)
        return peak

    def _load(self) -> int:
        """Peaks a run with the same key stored; how many."""
        if self.store is None:
            return 0
        try:
            data = json.loads(self.store.read_text(encoding="utf-8"))
            if data.get("key") != self.key:
                return 0
            self._peaks.update({(int(r), int(n)): int(b) for r, n, b in data["peaks"]})
        except (OSError, ValueError, KeyError, TypeError):
            return 0  # none, another run's, or unreadable: estimated afresh
        return len(self._peaks)

    def _save(self, key: tuple[int, int], peak: int) -> None:
        self._peaks[key] = peak
        if self.store is None or self.loss_fn is not None:  # a caller's loss function is not part of the key
            return
        body = json.dumps({"key": self.key, "peaks": [[r, n, b] for (r, n), b in sorted(self._peaks.items())]})
        try:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.store.with_suffix(".tmp")
            tmp.write_text(body, encoding="utf-8")
            os.replace(tmp, self.store)
        except OSError:
            pass  # a run never fails for its cache

    def known(self, length: int, rows: int, peak: int) -> None:
        """Micro-batches of ``length``'s bucket take at most ``rows`` rows, whose peak is ``peak`` bytes: a plan's
        micro-batch and its full estimate (``memfit.plan``'s, made within the budget with the CUDA context
        counted, stricter than this class's own test), so the run follows the plan and needs no estimate."""
        bucket = self.bucket(length)
        self._rows[bucket] = max(1, min(int(rows), self.max_rows))
        self._peaks.setdefault((self._rows[bucket], bucket), int(peak))

    def max_rows_at(self, length: int) -> int:
        """The most rows of ``length``'s bucket whose predicted peak is within the budget (at least 1:
        one row is always tried; the run's out-of-memory handling says when even that fails)."""
        length = self.bucket(length)
        if length not in self._rows:
            self._rows[length] = self._search(length)
        return self._rows[length]

    def _search(self, length: int) -> int:
        lo, hi = 1, self.max_rows + 1  # lo rows fit (one is always tried), hi do not
        for other, rows in self._rows.items():  # fewer rows fit a longer bucket, never more
            if other < length:
                hi = min(hi, rows + 1)
            elif other > length:
                lo = max(lo, rows)
        if hi - lo <= 1:
            return lo
        if self._line is not None:  # the first bucket's bytes a row adds, scaled by the row's tokens
            first, fixed, per_row = self._line
            guess = (self.budget - fixed) * first // max(1, per_row * length)
        else:  # the bytes a row adds, from one and two rows
            one = self.peak(1, length)
            two = self.peak(2, length) if one <= self.budget else one
            if two > self.budget:
                return 1
            lo = max(lo, 2)
            self._line = (length, one - (two - one), max(1, two - one))
            guess = 1 + (self.budget - one) // max(1, two - one)
        # gallop from the guess until the answer is bracketed, then bisect; typically two estimates
        step, heading = 1, None
        while hi - lo > 1:
            rows = min(max(guess, lo + 1), hi - 1)
            fits = self.peak(rows, length) <= self.budget
            lo, hi = (rows, hi) if fits else (lo, rows)
            if heading in (None, fits):
                guess, step, heading = rows + step if fits else rows - step, step * 2, fits
            else:
                guess = (lo + hi) // 2
        return lo

    def bound(self, rows: int, length: int) -> int:
        """The predicted peak of ``rows`` rows of ``length``'s bucket if that shape was estimated;
        otherwise the bucket's largest fitting shape's (an upper bound, one estimate a bucket)."""
        key = (int(rows), self.bucket(length))
        if key in self._peaks:
            return self._peaks[key]
        return self.peak(self.max_rows_at(length), length)

    def fits(self, rows: int, length: int, scale: float = 1.0) -> bool:
        """Whether ``rows`` rows padded to ``length`` fit; ``scale`` < 1 after out-of-memory errors."""
        if not 0 < scale <= 1:
            raise MemfitError(f"scale must be in (0, 1], got {scale}")
        return rows <= max(1, int(self.max_rows_at(length) * scale))
