"""``plan`` across GPUs: the fastest per-rank recipe of a data-parallel run that fits each card.

The search: parallel (DDP; FSDP2 resharding after forward, ZeRO-3-like; FSDP2 keeping gathered
parameters to backward, ZeRO-2-like; FSDP2 with ``CPUOffloadPolicy``, at any GPU count, one
included; over several nodes HSDP and FSDP2 over every rank) x activation checkpointing (off, every block) x the per-rank
micro-batch (divisors of global batch / ranks; the rest is accumulation, gradients synced on the
last micro-batch). Mixed precision is bf16 where the card has it: FSDP2's ``MixedPrecisionPolicy``
(bf16 compute, fp32 reduce, fp32 shards, as torchtitan trains), autocast for DDP. Every candidate's
memory is a real per-rank estimate: one rank's step run by FSDP2 / DDP themselves under PyTorch's fake
process group (``estimator/estimate.py``), replayed through the caching-allocator model under the
card's limit; for each structure the largest micro-batch that fits is found by bisection over the
divisors (memory grows with the micro-batch), so a structure costs a few traces, not one per size.

Step time per rank: the traced kernels of the steady step (``cost.py``'s roofline on the card),
plus the collectives, overlapped with compute as FSDP2 prefetches and DDP buckets do: the step takes
max(compute, communication) plus one unit's all-gather that nothing hides. Collectives are rings:
an all-gather or reduce-scatter of B bytes moves B x (n-1)/n per rank, an all-reduce twice that, at
the card's NVLink (or PCIe) rate within a node and ``NETWORK_BANDWIDTH`` between nodes
(``hardware/gpus.py``), at the host link's efficiency. FSDP2 all-gathers every unit in forward, and
again in backward when it reshards, for every micro-batch; it reduce-scatters once per step (sync on
the last micro-batch) or once per micro-batch; HSDP adds an all-reduce of the shards between nodes; DDP all-reduces the
gradients once per step. Offload adds, unhidden, each gathered shard over the host link (fp32, per
gather), the sharded gradients back, and the optimizer step on the host at ``HOST_STEP_BANDWIDTH``.

The mesh: beside data parallel alone, FSDP2 x TP at each degree ``tp_degrees`` allows (dividing the model's
heads and MLP width and a node's GPUs, at most ``MAX_TP``), as torchtitan runs TP (sequence and loss
parallel, the bf16 policy, gradients reduced every micro-batch): the data-parallel ranks are size / tp and
split the global batch, TP peers read the same rows. TP's collectives are added unhidden (``tp_seconds``). For a
mixture of experts with an expert plan, FSDP2 x EP at each degree ``ep_degrees`` allows: the experts split over
ep ranks of a node, every rank reading its own rows; the all-to-alls are added unhidden (``ep_seconds``) and
FSDP2 gathers each expert over its copies only (``planner/mesh.py``). Over several nodes, FSDP2 x TP x PP at each
degree ``pp_degrees`` allows (1F1B, micro-batches of one row, every block checkpointed, TP at the largest degree
searched): each candidate is a full per-rank estimate of every stage (``estimate``, each stage on the depth fast
path) at pp micro-batches (1F1B keeps at most pp in flight, so more micro-batches of the same size add none); its
step time is the stage's share of the kernels over ``m + pp - 1`` slots, FSDP2's collectives of a stage's weights
(gathered once, reduced once a step under torch's ``PipelineStage``) and the point-to-point sends (``pp_seconds``).
For sequences of ``CP_FROM`` tokens or more, FSDP2 x CP at each degree ``cp_degrees`` allows (torch's ring
attention over cp ranks of each FSDP2 group; CP peers read the same rows), the ring's collectives added unhidden
(``cp_seconds``); the candidate is traced on the first CP rank and the chosen one estimated on the first and last.
A deep decoder of identical blocks is traced at 2 and 4 blocks and each candidate composed at full depth
(``_Point.at``; a shallow copy out of memory is out of memory deep); the chosen plan is estimated in full,
and one predicted to fit whose full estimate does not is passed over.

Written here because no library plans these together: torchtitan's memory estimation mode and
DeepSpeed's ``estimate_zero3_model_states_mem_needs`` give one configuration's memory (the latter
without activations), and nobody ranks configurations by speed under a memory limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.hardware.cluster import World, fake_world
from memfit.hardware.gpus import NETWORK_BANDWIDTH, peer_link
from memfit.planner.cost import EFFICIENCY, Speed
from memfit.planner.mesh import (MAX_SHARD, MAX_TP, bubble, cp_degrees, cp_seconds, cp_structures, ep_degrees,
                                 ep_seconds, ep_structures, expert_parameters, pp_degrees, pp_seconds, pp_structure,
                                 pp_world, tp_degrees, tp_seconds, tp_structures)
from memfit.planner.result import CLEAN_SLOWDOWN, NothingFits, Plan, Plans, clean as is_clean
from memfit.planner.terms import KernelRows, Phases
from memfit.techniques.accumulation import MAX_ACCUM_STEPS, divisors
from memfit.techniques.parallel import mixed_dtypes
from memfit.techniques.recipe import Recipe
from memfit.units import format_size

__all__ = ["plan_ranks", "NoWorld", "structures", "tp_structures", "tp_degrees", "tp_seconds", "comm_seconds",
           "offload_seconds", "smallest_world", "offload_fits", "WORLDS", "MAX_TP", "ep_degrees", "ep_structures",
           "ep_seconds"]

#: GPU counts tried for a run that fits no single card (``smallest_world``)
WORLDS = (2, 4, 8, 16, 32, 64)
#: micro-batches a candidate's per-rank trace runs (``plan_ranks``)
TRACED_MICRO = 3


def structures(card, world: World, has_blocks: bool, optimizer: str) -> list[dict]:
    """The recipe structures searched (without the micro-batch), likely fastest first."""
    bf16 = card is None or card.bf16
    ddp = {"parallel": "ddp", "precision": "bf16-mixed" if bf16 else "fp32"}
    policy = {"mixed_precision": "bf16:fp32"} if bf16 else {}
    zero2 = {"parallel": "fsdp", "reshard_after_forward": "false", **policy}
    zero3 = {"parallel": "fsdp", **policy}
    # offloaded gradients are reduced every micro-batch: kept unsharded (sync on the last) they would
    # sit on the GPU whole, which is what offload is there to avoid
    offload = {**zero3, "offload": "cpu", "sync_grads": "every"}
    found = []
    host_step = not any(k in optimizer for k in ("8bit", "4bit", "paged", "fp8"))
    # over every rank: 1/size each (up to MAX_SHARD ranks: past them a trace takes minutes)
    spread = [{**zero3, "shard_over": "world"}] if 1 < world.nodes and world.size <= MAX_SHARD else []
    if spread and host_step:
        spread.append({**offload, "shard_over": "world"})
    for checkpointing in ("off", "blocks") if has_blocks else ("off",):
        bases = (ddp, zero2, zero3) if world.size > 1 else (zero3,)
        for base in bases + ((offload,) if host_step else ()) + tuple(spread):
            found.append({**base, "checkpointing": checkpointing, "optimizer": optimizer})
    return found


#: bytes/s one rank's share of the host streams through an offloaded optimizer step: a node's DRAM
#: (~400 GB/s for two sockets of DDR5) shared by 8 ranks. An assumption, like ``NETWORK_BANDWIDTH``.
HOST_STEP_BANDWIDTH = 50e9
#: bytes an AdamW step reads and writes per fp32 parameter: parameter, gradient, two moments read,
#: parameter and moments written (4 bytes each)
ADAMW_BYTES = 7 * 4


def offload_seconds(recipe: Recipe, world: World, params: int, micro_batches: int, card) -> float:
    """Seconds an offloaded step adds on top of the GPU's: each gather's shard over the host link (fp32,
    every micro-batch, twice when resharding), the sharded gradients back once, and the optimizer step
    on the host."""
    if recipe.offload == "none":
        return 0.0
    link = card.host_link_bandwidth * EFFICIENCY["host_link"]
    shard = params * 4 / (world.gpus if recipe.shard_over == "node" else world.size)
    gathers = (1 + (recipe.reshard_after_forward != "false")) * micro_batches
    reduces = micro_batches if recipe.sync_grads == "every" else 1
    return (gathers + reduces) * shard / link + shard / 4 * ADAMW_BYTES / HOST_STEP_BANDWIDTH


def comm_seconds(recipe: Recipe, world: World, params: int, units: int, micro_batches: int, card) -> tuple[float, float]:
    """(seconds of collectives per step, seconds of one unit's all-gather) for one rank (module docstring)."""
    if world.size == 1:
        return 0.0, 0.0
    efficiency = EFFICIENCY["host_link"]
    within = peer_link(card)[1] * efficiency
    between = NETWORK_BANDWIDTH * efficiency
    if recipe.parallel == "ddp":
        ring = 2 * params * 4 * (world.size - 1) / world.size  # fp32 gradients, one all-reduce per step
        return ring / (between if world.nodes > 1 else within), 0.0
    n = world.gpus if recipe.shard_over == "node" else world.size
    if recipe.shard_over == "world" and world.nodes > 1:  # one ring over every rank: as fast as its network hops
        within = between
    dtypes = mixed_dtypes(recipe.mixed_precision) or ("fp32", "fp32")
    gather_bytes, reduce_bytes = (4 if d == "fp32" else 2 for d in dtypes)
    gathers = 1 + (recipe.reshard_after_forward != "false")  # forward, and backward when resharded
    all_gather = params * gather_bytes * (n - 1) / n / within if n > 1 else 0.0
    reduces = micro_batches if recipe.sync_grads == "every" else 1
    seconds = all_gather * gathers * micro_batches
    seconds += reduces * params * reduce_bytes * (n - 1) / n / within if n > 1 else 0.0
    if world.nodes > 1 and recipe.shard_over == "node":  # HSDP: the shards all-reduced between nodes
        seconds += 2 * params / n * reduce_bytes * (world.nodes - 1) / world.nodes / between
    return seconds, all_gather / max(units, 1)


class NoWorld(MemfitError):
    """``smallest_world`` had no world to try: the global batch divides over none larger."""


@dataclass(frozen=True)
class _Point:
    """A candidate's per-rank memory and kernel seconds: one trace's, or composed at the model's depth from two
    shallow copies' (``depth.at_depth``: each phase's peak and kernel times are affine in depth; the step's peak,
    the highest of them, is not where the phase that peaks changes with depth: a shallow copy's peak in backward,
    the deep model's in the optimizer step, where the state outgrows the activations)."""

    peak_bytes: int
    reserved_bytes: int | None
    device_bytes: int
    verdict: str | None
    parameters: int
    compute: float
    retries: bool = False
    tight: bool = False
    phases: tuple = ()  # (phase, allocated peak) of each phase

    @classmethod
    def of(cls, report, compute: float) -> "_Point":
        # out of memory: what the step needs (held at the limit + missing), which is what grows with depth
        need = report.device_bytes + (report.missing_bytes or 0)
        return cls(report.peak_bytes, report.reserved_bytes, need, report.verdict, report.parameters,
                   compute, bool(report.retries), bool(report.tight), tuple(sorted(report.phase_peaks.items())))

    @classmethod
    def at(cls, low: "_Point", high: "_Point", a: int, b: int, depth: int, budget: int) -> "_Point":
        from memfit.estimator.depth import at_depth
        from memfit.estimator.verdict import FITS, OOM

        def line(x, y):
            return None if x is None or y is None else int(at_depth(x, y, a, b, depth))

        peak = line(low.peak_bytes, high.peak_bytes)
        # the highest phase at depth, each composed on its own; the device figures move with it
        lows, highs = dict(low.phases), dict(high.phases)
        phases = tuple((name, line(lows[name], highs[name])) for name in sorted(set(lows) & set(highs)))
        over = max(0, max((v for _, v in phases), default=peak) - peak)
        # the device holds at least the allocator's and the context's bytes above the allocated peak that the
        # shallow copies hold (their lines can cross below the allocated peak when the peak moves phase)
        above = min(low.device_bytes - low.peak_bytes, high.device_bytes - high.peak_bytes)
        device = max(line(low.device_bytes, high.device_bytes) + over, peak + over + max(0, above))
        reserved = line(low.reserved_bytes, high.reserved_bytes)
        # a shallow copy that does not fit: nor does the deeper model (memory grows with depth)
        fits = device <= budget and OOM not in (low.verdict, high.verdict)
        return cls(peak + over, None if reserved is None else reserved + over, device,
                   None if high.verdict is None else FITS if fits else OOM, line(low.parameters, high.parameters),
                   at_depth(low.compute, high.compute, a, b, depth), high.retries, high.tight, phases)


def _shallow_depths(source) -> tuple | None:
    """The two depths a deep decoder of identical blocks is traced at (``depth.SHALLOW``), or None: traced whole."""
    from memfit.estimator.depth import SHALLOW, layer_kinds
    from memfit.estimator.estimate import FAST_MIN_DEPTH

    depth = source.depth or 0
    if source.config is None or depth < FAST_MIN_DEPTH or len(set(layer_kinds(source.config, depth))) > 1:
        return None
    return SHALLOW


def plan_ranks(source, *, target, budget_bytes: int, world: World, global_batch_size: int, seq_len, optimizer: str,
               loss_fn=None, progress=None) -> Plans:
    """The fastest per-rank recipes that fit ``budget_bytes`` on each of ``world``'s GPUs (``target``): data
    parallel alone and, for a model with a tensor-parallel plan, FSDP2 x TP over each degree ``tp_degrees``
    allows (the mesh: dp x tp)."""
    from memfit.estimator.estimate import estimate
    from memfit.estimator.fake_trace import fake_trace
    from memfit.estimator.depth import at_depth
    from memfit.estimator.verdict import OOM
    from memfit.techniques.checkpointing import find_blocks

    start = time.perf_counter()
    speed = Speed.from_gpu(target)
    has_blocks = bool(source.depth)
    if not has_blocks:
        with _meta(source) as model:
            has_blocks = bool(model is not None and find_blocks(model))
    # the data-parallel ranks split the global batch: each TP degree whose dp = size / tp divides it
    degrees = [tp for tp in (tp_degrees(source, world) if world.size > 1 and loss_fn is None else [])
               if global_batch_size % (world.size // tp) == 0]
    # expert parallel borrows data-parallel ranks: every rank reads its own rows
    experts_at = [ep for ep in (ep_degrees(source, world) if world.size > 1 and loss_fn is None else [])
                  if global_batch_size % world.size == 0]
    if global_batch_size % world.size and not degrees:
        raise MemfitError(f"global_batch_size={global_batch_size} does not divide over {world.size} GPUs: use a "
                          f"multiple of {world.size}")
    shapes = [(1, fields) for fields in structures(target, world, has_blocks, optimizer)
              if global_batch_size % world.size == 0]
    shapes += [(tp, fields) for tp in degrees for fields in tp_structures(target, world, tp, has_blocks, optimizer)]
    shapes += [(1, fields) for ep in experts_at for fields in ep_structures(target, world, ep, has_blocks, optimizer)]
    # context parallel for long sequences: CP peers read the same rows (the data-parallel ranks are size / cp)
    rings = cp_degrees(source, world, seq_len, global_batch_size) if world.size > 1 and loss_fn is None else []
    shapes += [(cp, fields) for cp in rings for fields in cp_structures(target, world, cp, has_blocks, optimizer)]
    depths = _shallow_depths(source)
    config = source.config
    hidden = getattr(config, "hidden_size", 0) or 0
    top_k = getattr(getattr(config, "text_config", None) or config, "num_experts_per_tok", None) or 1
    heads = getattr(config, "num_attention_heads", 0) or 0
    kv_width = (getattr(config, "num_key_value_heads", None) or heads) * (
        getattr(config, "head_dim", None) or (hidden // heads if heads else 0))  # the keys' (and values') width
    expert_params = 0
    if experts_at:
        with _meta(source) as model:
            expert_params = expert_parameters(model) if model is not None else 0
    done, traces, results, notes = [0], [0], [], []
    if world.nodes > 1 and world.size > MAX_SHARD:
        notes.append(f"FSDP over all {world.size} ranks left out (past {MAX_SHARD} a per-rank trace takes minutes): "
                     "HSDP, sharded within each node, searched")
    if degrees:
        notes.append(f"tensor parallel searched at tp={', '.join(map(str, degrees))} (FSDP2 x TP, sequence and loss "
                     "parallel)")
    if experts_at:
        notes.append(f"expert parallel searched at ep={', '.join(map(str, experts_at))} (FSDP2 x EP, balanced "
                     "routing; memfit estimate --moe-routing worst bounds it)")
    # pipeline parallel over several nodes, at the largest TP degree searched (torchtitan pairs PP with TP 8)
    staged = max(degrees, default=1)
    pipelines = pp_degrees(source, world, staged, global_batch_size) if world.size > 1 and loss_fn is None else []
    if pipelines:
        mesh = f"FSDP2 x TP {staged} x PP" if staged > 1 else "FSDP2 x PP"
        notes.append(f"pipeline parallel searched at pp={', '.join(map(str, pipelines))} ({mesh}, "
                     "1F1B, micro-batches of one row, every block checkpointed; traced at pp micro-batches: 1F1B keeps "
                     "at most pp in flight)")
    if rings:
        notes.append(f"context parallel searched at cp={', '.join(map(str, rings))} (FSDP2 x CP, torch's ring "
                     "attention; memfit's CP is not yet checked against a GPU)")
    if depths:
        notes.append(f"each candidate traced at {depths[0]} and {depths[1]} blocks and composed at {source.depth} "
                     "(memory and kernel time affine in depth); the chosen one is estimated at full depth")
    total = (len(shapes) * (2 + max(1, (global_batch_size // world.size).bit_length())) + 2 * len(pipelines)) \
        * len(depths or (0,))

    def tick():
        done[0] += 1
        if progress is not None:
            progress(min(done[0], total), total)

    def kernels(model, recipe: Recipe, micro: int, traced: int):
        """(report, seconds of one micro-batch's kernels, seconds of the optimizer step's) of ``recipe`` traced with
        ``traced`` micro-batches of ``micro`` rows."""
        with fake_world(world, 0):
            report, replay = fake_trace(model, None, recipe=recipe.replace(grad_accum_steps=traced), loss_fn=loss_fn,
                                        optimizer=None, steps=2, batch_size=micro * traced, seq_len=seq_len, gpu=target,
                                        budget=budget_bytes, detail=True)
        tick()
        rows = KernelRows.of(replay.ops)
        phases = Phases(replay.series)
        micro_rows = rows.where(phases.mask(rows.marks(), "forward", 1) | phases.mask(rows.marks(), "backward", 1))
        step_rows = rows.where(phases.mask(rows.marks(), "optimizer", 1))
        return report, speed.kernel_seconds(micro_rows.cost()) / traced, speed.kernel_seconds(step_rows.cost())

    def one(model, recipe: Recipe, micro: int, traced: int) -> _Point:
        report, per_micro, step = kernels(model, recipe, micro, traced)
        return _Point.of(report, per_micro * recipe.grad_accum_steps + step)

    def trace(fields: dict, micro: int, per_rank: int):
        """(recipe, point, micro-batches traced): memory stops changing after the second micro-batch, so at most
        ``TRACED_MICRO`` run (a per-rank batch of thousands of micro-batches would trace each one, twice); the
        step's kernels are scaled to all of them."""
        recipe = Recipe(**fields, micro_batch_size=micro, grad_accum_steps=per_rank // micro)
        traced = min(recipe.grad_accum_steps, TRACED_MICRO)
        traces[0] += 1
        if depths is None:
            return recipe, one(source, recipe, micro, traced), traced
        low, high = (one(source.shallow(d), recipe, micro, traced) for d in depths)
        return recipe, _Point.at(low, high, *depths, source.depth, budget_bytes), traced

    for split, fields in shapes:
        per_rank = global_batch_size // (world.size // split)  # TP and CP peers read the same rows
        tp = fields.get("tp", 1)
        sizes = sorted((d for d in divisors(per_rank) if per_rank // d <= MAX_ACCUM_STEPS), reverse=True)
        fit = _largest_fitting(lambda f, m: trace(f, m, per_rank), fields, sizes)
        if fit is None:
            continue
        recipe, point, traced = fit
        dp_world = World(world.gpus // tp, world.nodes)
        # FSDP2 gathers an expert-parallel model's experts only over their copies (efsdp): 1/ep of them a rank moves
        gathered = point.parameters - expert_params + expert_params // recipe.ep
        comm, exposed = comm_seconds(recipe, dp_world, gathered, (source.depth or 0) + 1, recipe.grad_accum_steps,
                                     target)
        exposed += tp_seconds(recipe, recipe.micro_batch_size, seq_len or 0, hidden, source.depth or 0,
                              recipe.grad_accum_steps, target)
        exposed += ep_seconds(recipe, recipe.micro_batch_size, seq_len or 0, hidden, source.depth or 0, top_k,
                              recipe.grad_accum_steps, target)
        exposed += cp_seconds(recipe, recipe.micro_batch_size, seq_len or 0, kv_width, source.depth or 0,
                              recipe.grad_accum_steps, target)
        # the host's optimizer step and the shard copies are not hidden behind the GPU's kernels
        seconds = max(point.compute, comm) + exposed + offload_seconds(recipe, dp_world, point.parameters,
                                                                        recipe.grad_accum_steps, target)
        samples = global_batch_size / seconds
        tokens = samples * seq_len if seq_len else None
        results.append((Plan(recipe, point.peak_bytes, point.reserved_bytes, point.device_bytes, seconds, samples,
                             tokens, verified=False, verdict=point.verdict), point, point.compute, comm))
    estimated = {}  # a pipeline candidate's recipe -> its full per-rank estimate (every stage)

    def _flat_kernels(fields: dict):
        """(seconds of one micro-batch's kernels, of the optimizer step's, parameters) of the whole model on the
        pipeline's mesh without the pipeline, one row a micro-batch; composed at depth from the shallow copies."""
        flat = Recipe(**{k: v for k, v in fields.items() if k not in ("pp", "pp_schedule")}, micro_batch_size=1,
                      grad_accum_steps=1)
        if depths is None:
            whole, per_micro, step = kernels(source, flat, 1, 1)
            return per_micro, step, whole.parameters
        (low, low_micro, low_step), (high, high_micro, high_step) = (kernels(source.shallow(d), flat, 1, 1)
                                                                      for d in depths)
        return (at_depth(low_micro, high_micro, *depths, source.depth), at_depth(low_step, high_step, *depths,
                                                                                  source.depth),
                int(at_depth(low.parameters, high.parameters, *depths, source.depth)))

    flat = None
    for pp in pipelines:
        fields = pp_structure(target, staged, pp, optimizer)
        dp = world.size // (staged * pp)
        rows = global_batch_size // dp
        traced = Recipe(**fields, micro_batch_size=1, grad_accum_steps=pp)
        traces[0] += 1
        try:
            report = estimate(source, recipe=traced, batch_size=dp * pp, seq_len=seq_len, gpu=target,
                              budget=budget_bytes, gpus=world.gpus, nodes=world.nodes)
        except MemfitError as err:  # a model pipelining cannot cut (no model.layers, too few blocks for a stage)
            notes.append(f"pp={pp} passed over: {err}")
            continue
        finally:
            tick()
        if report.verdict == OOM:
            continue
        # the stage's kernels: 1/pp of the same mesh's without the pipeline (one trace for every pp degree)
        if flat is None:
            flat = _flat_kernels(fields)
        per_micro, step, parameters = flat
        recipe = traced.replace(grad_accum_steps=rows)
        compute = (rows + pp - 1) * per_micro / pp + step / pp
        stage_world = pp_world(world, staged, pp)
        comm, exposed = comm_seconds(recipe.replace(grad_accum_steps=1), stage_world, parameters // pp,
                                     (source.depth or 0) // pp + 1, 1, target)
        exposed += tp_seconds(recipe, 1, seq_len or 0, hidden, (source.depth or 0) // pp, rows + pp - 1, target)
        exposed += pp_seconds(recipe, 1, seq_len or 0, hidden, target, between_nodes=dp * staged >= world.gpus)
        seconds = max(compute, comm) + exposed
        plan = Plan(recipe, report.peak_bytes, report.reserved_bytes, report.device_bytes, seconds,
                    global_batch_size / seconds, global_batch_size * seq_len / seconds if seq_len else None,
                    verified=False, verdict=report.verdict)
        estimated[recipe] = report
        results.append((plan, _Point.of(report, compute), compute, comm))
    if not results:
        try:
            found = smallest_world(source, target, budget_bytes, global_batch_size, seq_len, optimizer, loss_fn,
                                   gpus_per_node=world.gpus, above=world.size)
        except NoWorld as err:
            found = str(err)
        more = (found if isinstance(found, str) else f"no larger world of these up to {MAX_SHARD} GPUs fits either"
                if found is None else
                f"{found[0].describe()} fit: {format_size(found[1].device_bytes)} per rank by a per-rank estimate of "
                f"{Recipe.from_dict(found[1].settings['recipe']).describe()} (--gpus {found[0].gpus} --nodes "
                f"{found[0].nodes} for the fastest)")
        raise NothingFits(f"nothing fits {world.describe()} x {target.name} ({format_size(budget_bytes)} each): "
                          f"every structure is over budget at micro-batch 1; {more}", None)
    results.sort(key=lambda item: (item[0].step_seconds, item[0].device_bytes))
    # as the single-card plan: a clean fit (no retry, no expandable segments, the measured error to
    # spare) wins unless a tight or conditional one is more than CLEAN_SLOWDOWN faster
    clean = [item for item in results if is_clean(item[1])]
    if clean and clean[0] is not results[0] and clean[0][0].step_seconds <= results[0][0].step_seconds * CLEAN_SLOWDOWN:
        notes.append(f"{results.index(clean[0])} faster candidate(s) fit only tightly or with a setting: the fastest "
                     "clean fit is chosen")
        results.remove(clean[0])
        results.insert(0, clean[0])
    # the first whose full estimate fits (a composed candidate is a prediction: its full estimate decides)
    for index, (best, point, compute, comm) in enumerate(results[:1 + 2 * bool(depths)]):
        checked = estimated.get(best.recipe) or estimate(
            source, recipe=best.recipe, batch_size=global_batch_size, seq_len=seq_len, gpu=target, budget=budget_bytes,
            gpus=world.gpus, nodes=world.nodes, loss_fn=loss_fn)
        if checked.verdict != OOM or not depths:
            break
        notes.append(f"{best.recipe.describe()} was predicted to fit and its full estimate does not: passed over")
    if checked.verdict == OOM:
        raise NothingFits(f"nothing fits {world.describe()} x {target.name} ({format_size(budget_bytes)} each): the "
                          f"fastest candidates predicted to fit do not by their full estimates ({best.recipe.describe()}"
                          f": {format_size(checked.device_bytes + (checked.missing_bytes or 0))} a rank)", None)
    results = results[index:]
    link, rate = peer_link(target)
    tp, ep, pp = best.recipe.tp, best.recipe.ep, best.recipe.pp
    mesh = f"dp={world.size // tp // pp} x tp={tp}" if tp > 1 else f"dp={world.size // pp}"
    if pp > 1:
        mesh = f"pp={pp} x {mesh}"
    if ep > 1:
        mesh += f" x ep={ep} (experts)"
    cp = best.recipe.cp
    if cp > 1:
        mesh = f"dp={world.size // cp} x cp={cp} (sequence)"
    r, depth = best.recipe, source.depth or 0
    ep_ms = ep_seconds(r, r.micro_batch_size, seq_len or 0, hidden, depth, top_k, r.grad_accum_steps, target) * 1000
    # a stage's TP collectives: its blocks, over the m + pp - 1 slots of a 1F1B step
    tp_ms = tp_seconds(r, r.micro_batch_size, seq_len or 0, hidden, depth // pp, r.grad_accum_steps + pp - 1,
                       target) * 1000
    cp_ms = cp_seconds(r, r.micro_batch_size, seq_len or 0, kv_width, depth, r.grad_accum_steps, target) * 1000
    p2p_ms = pp_seconds(r, 1, seq_len or 0, hidden, target, world.size // pp >= world.gpus) * 1000
    reasons = (f"{r.describe()} on {world.describe()} ({mesh}): {format_size(checked.device_bytes)} per rank "
               f"of {format_size(budget_bytes)} (the highest rank's full estimate)",
               f"per step: {compute * 1000:,.0f} ms of kernels and {comm * 1000:,.0f} ms of data-parallel collectives "
               f"({link} {rate / 1e9:,.0f} GB/s within a node"
               + (f", {NETWORK_BANDWIDTH / 1e9:,.0f} GB/s per GPU between nodes, assumed" if world.nodes > 1 else "")
               + "), overlapped"
               + (f"; {tp_ms:,.0f} ms of TP collectives, not overlapped" if tp > 1 else "")
               + (f"; {ep_ms:,.0f} ms of EP all-to-alls (balanced routing), not overlapped" if ep > 1 else "")
               + (f"; {cp_ms:,.0f} ms of the ring's all-gathers and reduce-scatters, not overlapped" if cp > 1 else "")
               + (f"; 1F1B over {pp} stages and {r.grad_accum_steps} micro-batches idles "
                  f"{bubble(pp, r.grad_accum_steps):.0%} of the step (the bubble); {p2p_ms:,.0f} ms of point-to-point "
                  f"sends, not overlapped; memory traced at {pp} micro-batches (1F1B keeps at most {pp} in flight)"
                  if pp > 1 else ""))
    chosen = Plan(best.recipe, checked.peak_bytes, checked.reserved_bytes, checked.device_bytes, best.step_seconds,
                  best.samples_per_second, best.tokens_per_second, verified=True, reasons=reasons,
                  verdict=checked.verdict, seq_len=seq_len)
    rest = [plan for plan, *_ in results[1:]]
    searched = len(shapes) + len(pipelines)
    notes.append(f"{len(results)} of {searched} structures fit; {traces[0]} per-rank candidates traced")
    settings = {"model": source.name, "global_batch_size": global_batch_size, "seq_len": seq_len,
                "optimizer": optimizer, "gpus": world.gpus, "nodes": world.nodes, "traces": traces[0],
                "speed": speed.name, "tp_degrees": degrees, "ep_degrees": experts_at, "pp_degrees": pipelines,
                "cp_degrees": rings}
    return Plans([chosen] + rest, budget=budget_bytes, device="cuda", gpu=target.name, candidates=searched,
                 front=[], seconds=time.perf_counter() - start, report=checked, settings=settings, notes=notes)


def smallest_world(source, target, budget_bytes: int, global_batch_size: int, seq_len, optimizer: str, loss_fn=None,
                   gpus_per_node: int | None = None, above: int = 1):
    """(World, per-rank Report) of the fewest GPUs of ``target`` over which FSDP2 (resharding, bf16
    policy where the card has it, every block checkpointed, micro-batch 1, gradients reduced every
    micro-batch) fits ``budget_bytes`` per
    rank, by full per-rank estimates: one node of ``WORLDS`` GPUs, or with ``gpus_per_node`` that many
    per node on 1, 2, 4, ... nodes; only worlds of more than ``above`` GPUs whose size divides the
    batch, and at most ``MAX_SHARD`` ranks sharded together. None if none of those fits. Stops at the
    first that fits: the answer of a plan that found nothing, not a search for speed."""
    from memfit.estimator.estimate import estimate
    from memfit.estimator.verdict import OOM

    fields = {"parallel": "fsdp", "optimizer": optimizer, "micro_batch_size": 1, "sync_grads": "every"}
    if target.bf16:
        fields["mixed_precision"] = "bf16:fp32"
    if source.depth:
        fields["checkpointing"] = "blocks"
    worlds = [World(n) for n in WORLDS] if gpus_per_node is None else \
        [World(gpus_per_node, nodes) for nodes in WORLDS if nodes > 1 or gpus_per_node > 1]
    if gpus_per_node is not None:
        worlds.insert(0, World(gpus_per_node))
    tried, past = None, False
    for world in worlds:
        if world.size <= above or global_batch_size % world.size:
            continue
        if world.size > MAX_SHARD:  # sharded over every rank, past what a plan traces in reasonable time
            past = True
            continue
        # memory stops changing after the second micro-batch: two are traced, not all of them; over
        # nodes, HSDP would hold what one node holds: shard over every rank
        accum = min(global_batch_size // world.size, 2)
        recipe = Recipe(**fields, grad_accum_steps=accum, shard_over="node" if world.nodes == 1 else "world")
        report = estimate(source, recipe=recipe, batch_size=accum * world.size, seq_len=seq_len, gpu=target,
                          budget=budget_bytes, gpus=world.gpus, nodes=world.nodes, loss_fn=loss_fn)
        tried = world
        if report.verdict != OOM:
            return world, report
    if tried is None and not past:
        raise NoWorld(f"the global batch of {global_batch_size} divides over no larger world of {target.name}s to "
                      "try: use a global batch that is a multiple of the GPU count")
    return None


def offload_fits(source, target, budget_bytes: int, global_batch_size: int, seq_len, optimizer: str, loss_fn=None):
    """The per-rank Report of FSDP2 with ``CPUOffloadPolicy`` on one ``target`` (bf16 policy where the
    card has it, every block checkpointed, micro-batch 1, gradients reduced every micro-batch) if it
    fits ``budget_bytes``, else None."""
    from memfit.estimator.estimate import estimate
    from memfit.estimator.verdict import OOM

    if any(k in optimizer for k in ("8bit", "4bit", "paged", "fp8")):
        return None
    accum = min(global_batch_size, 2)  # memory stops changing after the second micro-batch
    fields = {"parallel": "fsdp", "offload": "cpu", "optimizer": optimizer, "micro_batch_size": 1,
              "grad_accum_steps": accum, "sync_grads": "every"}
    if target.bf16:
        fields["mixed_precision"] = "bf16:fp32"
    if source.depth:
        fields["checkpointing"] = "blocks"
    report = estimate(source, recipe=Recipe(**fields), batch_size=accum, seq_len=seq_len, gpu=target,
                      budget=budget_bytes, gpus=1, loss_fn=loss_fn)
    return None if report.verdict == OOM else report


def _largest_fitting(trace, fields: dict, sizes: list[int]):
    """(recipe, report, replay) at the largest micro-batch of ``sizes`` (descending) that fits, or None."""
    from memfit.estimator.verdict import OOM

    def fits(result):
        return result[1].verdict != OOM

    first = trace(fields, sizes[0])
    if fits(first):
        return first
    last = trace(fields, sizes[-1]) if len(sizes) > 1 else first
    if not fits(last):
        return None
    low, high, best = 0, len(sizes) - 1, last  # sizes[low] does not fit, sizes[high] does
    while high - low > 1:
        middle = (low + high) // 2
        result = trace(fields, sizes[middle])
        if fits(result):
            high, best = middle, result
        else:
            low = middle
    return best


class _meta:
    """The model built on the meta device, for a look at its blocks (None if it cannot be built)."""

    def __init__(self, source):
        self.source = source

    def __enter__(self):
        import torch

        try:
            with torch.device("meta"):
                return self.source.build()
        except Exception:  # noqa: BLE001 — only a look; the traces report a model that does not build
            return None

    def __exit__(self, *exc):
        return False
