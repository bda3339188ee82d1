"""The depth fast path: trace a shallow copy of a model, write out its log at the real depth.

A full fake trace costs ~0.3 s per block and step on 2 cores, so an 80-block model takes about
a minute. The blocks of a decoder repeat, so a shallow copy holds every pattern of the deep
model's step: for identical blocks four (the first, a second, a middle one and the last).
``accounting/synth.py`` writes the deep model's allocation log from the shallow one (the middle
block repeated, references between neighbouring blocks kept), and the log is replayed exactly as
a full trace's is: the replay gives the unrounded peak, its categories, the phase peaks and the
timeline, and on a GPU the caching-allocator model gives ``max_memory_allocated`` and
``max_memory_reserved``. The reserved-over-allocated gap is not a line in depth (which cached
segment a request lands in depends on all before it), which is why the stream is replayed rather
than two shallow traces' figures extrapolated, as this module did before.

Blocks that differ by index are kept where the deep model has them (``template``): each block's
kind is read from the config (``layer_types``, ``no_rope_layers``, ``moe_layers``,
``first_k_dense_replace``...: ``layer_kinds``), the blocks are cut into units of the period
(Gemma 3's five sliding and one full layer: 6; gpt-oss's alternation: 2; Llama 4's MoE every
other layer and no RoPE every fourth: 4), the units before the repeated one are kept as they are
(DeepSeek-V3's and GLM-4.5's dense first layers), and the last unit may be short (Gemma 3 1B's 26
layers are four units of six and two). Where no copy is shallower than the model (Granite 4's
attention at layers 5, 15, 25 and 35 of 40) the model is traced in full.

``tests/test_depth.py``, ``tests/test_catalog_layers.py`` and ``bench/speed/fast_vs_full.py`` check it
against full traces.

Known limitations: module paths past the copy's blocks name the block the record was written as
(the deep model's index), but kernel scratch sites keep the shallow copy's names. Set-up tensors
the model makes per layer outside the blocks are the copy's: a training forward with
``use_cache`` builds a ``DynamicCache`` holding an 8-byte tensor per sliding-window layer, so
gpt-oss's or Gemma 3's peak can be that many bytes below the full trace's.
"""

from __future__ import annotations

import contextlib
import dataclasses

from memfit.accounting.replay import replay
from memfit.errors import MemfitError
from memfit.accounting.synth import synthesise
from memfit.techniques.checkpointing import checkpoint_plan
from memfit.estimator.fake_trace import fake_trace
from memfit.models.source import Source
from memfit.report.report import Report
from memfit.estimator.trace import fold_peaks, numel
from memfit.estimator.verdict import cuda_fit

__all__ = ["estimate_by_depth", "SHALLOW", "Template", "layer_kinds", "template", "plan_copy", "at_depth"]

# The depths the planner traces to compose candidates (``compose.py``): even, so architectures
# alternating two kinds of layer stay whole.
SHALLOW = (2, 4)


def at_depth(low, high, a: int, b: int, depth: int):
    """A figure at ``depth`` blocks from the same figure traced at ``a`` and ``b`` blocks: phase peaks
    and kernel times are affine in depth (the blocks are identical). The planner composes its
    candidates this way (``planner/terms.py``); ``estimate`` writes the log out instead (above)."""
    return low + (high - low) * (depth - a) / (b - a)


@dataclasses.dataclass(frozen=True)
class Template:
    """Which blocks of the deep model the shallow copy keeps: units of ``unit`` blocks, the first
    ``middle`` units written once each, unit ``middle`` written for every unit up to the last but
    one (it and the unit before it are of the same kinds as all of those), then the last unit,
    which may be short where the depth is not a multiple of the unit."""

    unit: int
    middle: int  # index of the repeated unit (2 for identical blocks: first, second, middle, last)
    depth: int  # blocks of the deep model

    @property
    def units(self) -> int:  # of the deep model, the short last one included
        return -(-self.depth // self.unit)

    @property
    def blocks(self) -> list[int]:
        """The deep model's block indices the copy keeps, in order."""
        head = list(range((self.middle + 1) * self.unit))
        return head + list(range((self.units - 1) * self.unit, self.depth))


# per-layer fields that list layer indices rather than one value per layer
_INDEX_LISTS = ("moe_layers", "mlp_only_layers")
# per-layer patterns a config may derive rather than store (a shallow copy whose derived pattern is
# not the deep one's kept blocks fails the check in ``plan_copy`` and is traced in full)
_DERIVED = ("layer_types", "layers_block_type", "hybrid_override_pattern")


def layer_kinds(config, depth: int) -> list[tuple]:
    """What tells block ``i`` apart, from the config: every per-layer list's value (``layer_types``,
    ``no_rope_layers``...), membership of the index lists, and the rules by index transformers' models
    read (DeepSeek's and GLM's ``first_k_dense_replace``, Qwen MoE's ``decoder_sparse_step``)."""
    lists = {k: v for k, v in vars(config).items() if isinstance(v, list) and len(v) == depth
             and k not in _INDEX_LISTS and all(isinstance(x, (str, int, float, bool)) for x in v)}
    for key in _DERIVED:  # properties (Mamba's layer_types, Jamba's layers_block_type) or a string pattern
        value = getattr(config, key, None)
        lists[key] = list(value) if isinstance(value, (list, str)) else None
    index = {k: set(getattr(config, k)) for k in _INDEX_LISTS if isinstance(getattr(config, k, None), list)}
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    freq = getattr(config, "moe_layer_freq", 1) or 1
    sparse = getattr(config, "decoder_sparse_step", 1) or 1
    kinds = []
    for i in range(depth):
        kind = [(k, v[i]) for k, v in sorted(lists.items()) if isinstance(v, list) and len(v) == depth]
        kind += [(k, i in v) for k, v in sorted(index.items())]
        kinds.append(tuple(kind) + (i < dense, i % freq, (i + 1) % sparse))
    return kinds


def template(kinds: list, every: int = 1) -> Template | None:
    """The smallest copy whose written-out log is the deep model's: the unit (a multiple of ``every``,
    ``checkpointing=blocks:N``'s period) and repeated unit with the fewest blocks; None when no copy
    is smaller than the model (the full trace is then the cheaper)."""
    depth, best = len(kinds), None
    for unit in range(every, depth // 2 + 1, every):
        units = [tuple(kinds[j:j + unit]) for j in range(0, depth, unit)]
        middle = next((m for m in range(2, len(units) - 1) if len(set(units[m - 1:len(units) - 1])) == 1), None)
        if middle is None:
            continue
        candidate = Template(unit, middle, depth)
        if len(candidate.blocks) < depth and (best is None or len(candidate.blocks) < len(best.blocks)):
            best = candidate
    return best


def plan_copy(source: Source, recipe=None, part: range | None = None) -> Template | None:
    """The fast path's copy of ``source`` (None: trace it in full): the blocks' kinds from the config,
    cut into the smallest repeating template that keeps every kind where the deep model has it. ``part``: only
    those blocks of the deep model (a pipeline stage's), the template's indices counted within them."""
    depth = source.depth
    if not depth or source.config is None:
        return None
    every = 1
    if recipe is not None:
        kind, period = checkpoint_plan(recipe.checkpointing)
        if kind == "modules":
            return None
        every = period if kind == "blocks" else 1
    part = range(depth) if part is None else part
    whole = layer_kinds(source.config, depth)
    kinds = [whole[i] for i in part]
    found = template(kinds, every)
    if found is None:
        return None
    shallow = source.shallow([part[i] for i in found.blocks])
    # the copy's config must say of each kept block what the deep config says of it (rules by index, DeepSeek's
    # dense first layers, renumber in a stage's copy: such a stage is traced in full)
    return found if layer_kinds(shallow.config, len(found.blocks)) == [kinds[i] for i in found.blocks] else None


def estimate_by_depth(source: Source, *, recipe, loss_fn, optimizer, steps, batch_size, seq_len,
                      gpu=None, budget: int | None = None, tick=None, layout=None, workload: str = "train",
                      stage: tuple | None = None) -> Report:
    """The depth fast path's estimate. ``stage``: (this rank's pipeline stage, its blocks of the deep model): the
    stage is traced with a shallow copy of its blocks and its log written out at the stage's depth."""
    if recipe.compile:
        raise MemfitError("compile and the depth fast path conflict: a compiled step (whole or per block) has no "
                          "per-block records to write out; trace it in full (fast=False, --full)")
    depth = source.depth
    # safe_step's chunks are cut by the bytes of all parameters, not per block: traced in full
    part = stage[1] if stage is not None else None
    copy = None if recipe.safe_step is not None else plan_copy(source, recipe, part)
    if copy is None:
        report, _ = fake_trace(source, None, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer, steps=steps,
                               batch_size=batch_size, seq_len=seq_len, gpu=gpu, budget=budget, tick=tick,
                               layout=layout, workload=workload)
        kinds = layer_kinds(source.config, depth) if depth and source.config is not None else []
        if recipe.safe_step is None and len(set(kinds)) > 1 and template(kinds) is None:
            report = dataclasses.replace(report, notes=report.notes + [
                f"traced all {depth} blocks: their kinds of layer (layer_types, MoE or dense...) repeat with no "
                "period a shallower copy could keep"])
        return report
    unit, blocks = copy.unit, len(copy.blocks)
    if part is not None:
        from memfit.techniques.pipeline_parallel import traced_as

        depth = len(part)
        shallow = source.shallow([part[i] for i in copy.blocks])
        holding = traced_as(stage[0])  # the copy's blocks are all this rank's stage's
    else:
        shallow, holding = source.shallow(copy.blocks), contextlib.nullcontext()
    with holding:
        small, result = fake_trace(shallow, None, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer, steps=steps,
                                   batch_size=batch_size, seq_len=seq_len, gpu=gpu, keep=True, tick=tick,
                                   layout=layout, workload=workload)
    # a short last unit is written as a whole one whose missing blocks were never traced
    log = synthesise(result.ledger, depth=copy.units * unit, unit=unit)
    if log.unmatched and getattr(recipe, "parallel", "none") != "none":
        # FSDP2's units with a free the written log cannot place (a pipeline stage's gathered weights freed in its
        # root at the last backward, for some shapes): the written log would keep buffers alive, so the step is
        # traced in full
        report, _ = fake_trace(source, None, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer, steps=steps,
                               batch_size=batch_size, seq_len=seq_len, gpu=gpu, budget=budget, tick=None,
                               layout=layout, workload=workload)
        return dataclasses.replace(report, notes=report.notes + [
            f"traced in full: the depth fast path could not place {log.unmatched} free(s) of the {blocks}-block copy"])
    full = replay(log, result.scratch)
    cuda = {}
    if gpu is not None:
        # the written log is replayed under the card's limit like a full trace's (``verdict.py``)
        outside = dict(context_bytes=small.context_bytes, outside_bytes=small.outside_bytes, outside=small.outside)
        cuda = dict(cuda_fit(log, gpu, budget, outside=small.outside_total).report_fields(), **outside, gpu=small.gpu)
    parameters, trainable = _parameters(result.ledger, log)
    of = f"the stage's {depth}" if part is not None else f"{depth}"
    notes = small.notes + [f"traced {blocks} of {of} blocks and wrote the step's allocations out for all "
                           f"{depth} (fast=False or --full traces them all)"]
    if log.unmatched:
        notes.append(f"{log.unmatched} free(s) of the shallow trace had no counterpart at full depth")
    return Report(
        peak_bytes=cuda.pop("peak_bytes", full.peak_bytes),
        by_category=full.by_category,
        **fold_peaks(full.phase_peaks, steps),
        modules=full.modules,
        timeline=full.timeline,
        stacked=full.stacked,
        device=small.device,
        method="depth",
        modelled_bytes=full.scratch_at_peak,
        unprobed_ops=small.unprobed_ops,
        parameters=parameters,
        trainable=trainable,
        settings={**small.settings, "depth": depth, "traced_depths": [blocks]},
        notes=notes,
        **cuda,
    )


def _parameters(ledger, log) -> tuple[int, int]:
    """Logical weights and trainable weights of the deep model: each parameter of the shallow copy
    counted once per block its block was written as."""
    root = ledger.root  # the class name as built (FSDP2 renames the class of what it shards)
    total = trainable = 0
    for name, param in ledger.model.named_parameters():
        owner = f"{root}.{name.rsplit('.', 1)[0]}" if "." in name else root
        weights = log.copies(owner) * numel(param)
        total += weights
        trainable += weights if param.requires_grad else 0
    return total, trainable
