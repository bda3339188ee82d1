"""``plan`` across GPUs: the fastest per-rank recipe of a data-parallel run that fits each card.

The search: the data-parallel structures (``data_parallel.py``: DDP, FSDP2 ZeRO-3-like and ZeRO-2-like, FSDP2 with
``CPUOffloadPolicy`` at any GPU count, one included, over several nodes HSDP and FSDP2 over every rank) x
activation checkpointing (off, every block) x the per-rank micro-batch (divisors of global batch / ranks; the rest
is accumulation, gradients synced on the last micro-batch), and the mesh dimensions beside them (``mesh.py``).
Every candidate's memory is a real per-rank estimate: one rank's step run by FSDP2 / DDP themselves under
PyTorch's fake process group (``estimator/estimate.py``), replayed through the caching-allocator model under the
card's limit; ``search.py``'s ``RankSearch`` traces the candidates and prices their steps (kernels, collectives,
the pipeline's bubble). This module picks what is searched and chooses among what fits.

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
A deep decoder of identical blocks is traced at 2 and 4 blocks and each candidate composed at full depth; the
chosen plan is estimated in full, and one predicted to fit whose full estimate does not is passed over.

Written here because no library plans these together: torchtitan's memory estimation mode and
DeepSpeed's ``estimate_zero3_model_states_mem_needs`` give one configuration's memory (the latter
without activations), and nobody ranks configurations by speed under a memory limit.
"""

from __future__ import annotations

import time

from memfit.errors import MemfitError
from memfit.hardware.cluster import World
from memfit.hardware.gpus import NETWORK_BANDWIDTH, peer_link
from memfit.planner.data_parallel import comm_seconds, offload_seconds, structures
from memfit.planner.mesh import (MAX_SHARD, MAX_TP, bubble, cp_degrees, cp_seconds, cp_structures, ep_degrees,
                                 ep_seconds, ep_structures, expert_parameters, pp_degrees, pp_seconds, tp_degrees,
                                 tp_seconds, tp_structures)
from memfit.planner.result import CLEAN_SLOWDOWN, NothingFits, Plan, Plans, clean as is_clean
from memfit.planner.search import RankSearch
from memfit.techniques.recipe import Recipe
from memfit.techniques.zero_config import ZeroConfig, zero_stage
from memfit.units import format_size

__all__ = ["plan_ranks", "NoWorld", "structures", "tp_structures", "tp_degrees", "tp_seconds", "comm_seconds",
           "offload_seconds", "smallest_world", "offload_fits", "WORLDS", "MAX_TP", "ep_degrees", "ep_structures",
           "ep_seconds"]

#: GPU counts tried for a run that fits no single card (``smallest_world``)
WORLDS = (2, 4, 8, 16, 32, 64)


class NoWorld(MemfitError):
    """``smallest_world`` had no world to try: the global batch divides over none larger."""


def plan_ranks(source, *, target, budget_bytes: int, world: World, global_batch_size: int, seq_len, optimizer: str,
               loss_fn=None, progress=None, engines=("torch",)) -> Plans:
    """The fastest per-rank recipes that fit ``budget_bytes`` on each of ``world``'s GPUs (``target``): data
    parallel alone and, for a model with a tensor-parallel plan, FSDP2 x TP over each degree ``tp_degrees``
    allows (the mesh: dp x tp). ``engines``: PyTorch's (``torch``: DDP, FSDP2 and the meshes) and DeepSpeed's ZeRO
    stages (``deepspeed``), either or both."""
    from memfit.estimator.estimate import estimate
    from memfit.estimator.verdict import OOM
    from memfit.techniques.checkpointing import find_blocks

    start = time.perf_counter()
    has_blocks = bool(source.depth)
    if not has_blocks:
        with _meta(source) as model:
            has_blocks = bool(model is not None and find_blocks(model))
    meshes = "torch" in engines  # TP, EP, CP and PP are FSDP2's meshes
    # the data-parallel ranks split the global batch: each TP degree whose dp = size / tp divides it
    degrees = [tp for tp in (tp_degrees(source, world) if world.size > 1 and loss_fn is None and meshes else [])
               if global_batch_size % (world.size // tp) == 0]
    # expert parallel borrows data-parallel ranks: every rank reads its own rows
    experts_at = [ep for ep in (ep_degrees(source, world) if world.size > 1 and loss_fn is None and meshes else [])
                  if global_batch_size % world.size == 0]
    if global_batch_size % world.size and not degrees:
        raise MemfitError(f"global_batch_size={global_batch_size} does not divide over {world.size} GPUs: use a "
                          f"multiple of {world.size}")
    hidden = getattr(source.config, "hidden_size", None)
    shapes = [(1, fields) for fields in structures(target, world, has_blocks, optimizer, engines, hidden)
              if global_batch_size % world.size == 0]
    shapes += [(tp, fields) for tp in degrees for fields in tp_structures(target, world, tp, has_blocks, optimizer)]
    shapes += [(1, fields) for ep in experts_at for fields in ep_structures(target, world, ep, has_blocks, optimizer)]
    # context parallel for long sequences: CP peers read the same rows (the data-parallel ranks are size / cp)
    rings = (cp_degrees(source, world, seq_len, global_batch_size) if world.size > 1 and loss_fn is None and meshes
             else [])
    shapes += [(cp, fields) for cp in rings for fields in cp_structures(target, world, cp, has_blocks, optimizer)]
    expert_params = 0
    if experts_at:
        with _meta(source) as model:
            expert_params = expert_parameters(model) if model is not None else 0
    search = RankSearch(source, target=target, budget_bytes=budget_bytes, world=world,
                        global_batch_size=global_batch_size, seq_len=seq_len, optimizer=optimizer, loss_fn=loss_fn,
                        progress=progress, expert_params=expert_params)
    depths, notes = search.depths, search.notes
    if world.nodes > 1 and world.size > MAX_SHARD and meshes:
        notes.append(f"FSDP over all {world.size} ranks left out (past {MAX_SHARD} a per-rank trace takes minutes): "
                     "HSDP, sharded within each node, searched")
    if "deepspeed" in engines:
        notes.append("DeepSpeed ZeRO searched" + (" beside PyTorch's DDP and FSDP2" if meshes else " alone")
                     + f": stages 1-3, stage 2 with overlap_comm off and on, DeepSpeed's own "
                     f"{'bf16' if target.bf16 else 'fp16'}, buckets at the Hugging Face Trainer's auto sizes "
                     "(reduce_bucket_size hidden², stage 3 prefetch 0.9 hidden², persistence 10 hidden), and "
                     "ZeRO-Offload (stage 2 offload_optimizer, stage 3 offload_optimizer and offload_param) where the "
                     "optimizer steps on the host")
    if degrees:
        notes.append(f"tensor parallel searched at tp={', '.join(map(str, degrees))} (FSDP2 x TP, sequence and loss "
                     "parallel)")
    if experts_at:
        notes.append(f"expert parallel searched at ep={', '.join(map(str, experts_at))} (FSDP2 x EP, balanced "
                     "routing; memfit estimate --moe-routing worst bounds it)")
    # pipeline parallel over several nodes, at the largest TP degree searched (torchtitan pairs PP with TP 8)
    staged = max(degrees, default=1)
    pipelines = (pp_degrees(source, world, staged, global_batch_size) if world.size > 1 and loss_fn is None and meshes
                 else [])
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
    results = search.run(shapes, pipelines, staged)
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
        checked = search.estimated.get(best.recipe) or estimate(
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
    reasons = _reasons(search, best.recipe, checked, compute, comm)
    chosen = Plan(best.recipe, checked.peak_bytes, checked.reserved_bytes, checked.device_bytes, best.step_seconds,
                  best.samples_per_second, best.tokens_per_second, verified=True, reasons=reasons,
                  verdict=checked.verdict, seq_len=seq_len)
    rest = [plan for plan, *_ in results[1:]]
    searched = len(shapes) + len(pipelines)
    notes.append(f"{len(results)} of {searched} structures fit; {search.traces} per-rank candidates traced")
    settings = {"model": source.name, "global_batch_size": global_batch_size, "seq_len": seq_len,
                "optimizer": optimizer, "gpus": world.gpus, "nodes": world.nodes, "engines": list(engines),
                "traces": search.traces,
                "speed": search.speed.name, "tp_degrees": degrees, "ep_degrees": experts_at, "pp_degrees": pipelines,
                "cp_degrees": rings}
    return Plans([chosen] + rest, budget=budget_bytes, device="cuda", gpu=target.name, candidates=searched,
                 front=[], seconds=time.perf_counter() - start, report=checked, settings=settings, notes=notes)


def _reasons(search: RankSearch, r: Recipe, checked, compute: float, comm: float) -> tuple[str, str]:
    """The chosen plan's reasons: its mesh and memory, and its step's seconds of kernels and collectives."""
    world, target, seq_len, hidden = search.world, search.target, search.seq_len, search.hidden
    link, rate = peer_link(target)
    tp, ep, pp = r.tp, r.ep, r.pp
    mesh = f"dp={world.size // tp // pp} x tp={tp}" if tp > 1 else f"dp={world.size // pp}"
    if pp > 1:
        mesh = f"pp={pp} x {mesh}"
    if ep > 1:
        mesh += f" x ep={ep} (experts)"
    cp = r.cp
    if cp > 1:
        mesh = f"dp={world.size // cp} x cp={cp} (sequence)"
    depth = search.source.depth or 0
    ep_ms = ep_seconds(r, r.micro_batch_size, seq_len or 0, hidden, depth, search.top_k, r.grad_accum_steps,
                       target) * 1000
    # a stage's TP collectives: its blocks, over the m + pp - 1 slots of a 1F1B step
    tp_ms = tp_seconds(r, r.micro_batch_size, seq_len or 0, hidden, depth // pp, r.grad_accum_steps + pp - 1,
                       target) * 1000
    cp_ms = cp_seconds(r, r.micro_batch_size, seq_len or 0, search.kv_width, depth, r.grad_accum_steps, target) * 1000
    p2p_ms = pp_seconds(r, 1, seq_len or 0, hidden, target, world.size // pp >= world.gpus) * 1000
    # ZeRO's collectives that nothing hides: stage 1's reduction, the partitions gathered after the step
    # (module docstring of data_parallel.py)
    dp_world = World(world.gpus // tp // pp, world.nodes)
    unhidden = comm_seconds(r, dp_world, checked.parameters, depth + 1, r.grad_accum_steps, target)[1] * 1000
    overlapped = zero_stage(r) == 2 and ZeroConfig.parse(r.zero).get("overlap_comm") is True
    return (f"{r.describe()} on {world.describe()} ({mesh}): {format_size(checked.device_bytes)} per rank "
            f"of {format_size(search.budget_bytes)} (the highest rank's full estimate)",
            f"per step: {compute * 1000:,.0f} ms of kernels and {comm * 1000:,.0f} ms of data-parallel collectives "
            f"({link} {rate / 1e9:,.0f} GB/s within a node"
            + (f", {NETWORK_BANDWIDTH / 1e9:,.0f} GB/s per GPU between nodes, assumed" if world.nodes > 1 else "")
            + "), overlapped"
            + (f"; {unhidden:,.0f} ms more of ZeRO's, not overlapped ("
               + ("the updated partitions gathered after the step" if overlapped
                  else "the reduction and the updated partitions gathered after the step") + ")"
               if zero_stage(r) in (1, 2) else "")
            + (f"; {tp_ms:,.0f} ms of TP collectives, not overlapped" if tp > 1 else "")
            + (f"; {ep_ms:,.0f} ms of EP all-to-alls (balanced routing), not overlapped" if ep > 1 else "")
            + (f"; {cp_ms:,.0f} ms of the ring's all-gathers and reduce-scatters, not overlapped" if cp > 1 else "")
            + (f"; 1F1B over {pp} stages and {r.grad_accum_steps} micro-batches idles "
               f"{bubble(pp, r.grad_accum_steps):.0%} of the step (the bubble); {p2p_ms:,.0f} ms of point-to-point "
               f"sends, not overlapped; memory traced at {pp} micro-batches (1F1B keeps at most {pp} in flight)"
               if pp > 1 else ""))


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
