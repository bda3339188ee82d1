"""The data-parallel dimension ``plan`` searches across GPUs (``ranks.plan_ranks``): the structures it is tried
with and the seconds of its collectives and of an offloaded step. The other mesh dimensions (TP, EP, PP, CP) are
``mesh.py``'s; the search that traces them is ``search.py``'s.

The structures: DDP; FSDP2 resharding after forward, ZeRO-3-like; FSDP2 keeping gathered parameters to backward,
ZeRO-2-like; FSDP2 with ``CPUOffloadPolicy``, at any GPU count, one included; over several nodes HSDP and FSDP2
over every rank; each with activation checkpointing off and, for a model of blocks, every block. Mixed precision is
bf16 where the card has it: FSDP2's ``MixedPrecisionPolicy`` (bf16 compute, fp32 reduce, fp32 shards, as torchtitan
trains), autocast for DDP. Where the user allows DeepSpeed (``engines``), its ZeRO stages beside them
(``zero_structures``): stage 1; stage 2 with ``overlap_comm`` off and on (the second bucket buys the reductions'
overlap with backward); stage 3; where the optimizer steps on the host (not an 8/4-bit or paged one), ZeRO-Offload:
stage 2 with ``offload_optimizer=cpu`` and stage 3 with ``offload_optimizer`` and ``offload_param`` on the CPU, with
every block checkpointed (offload is for a run memory keeps from fitting otherwise); DeepSpeed's own bf16 (fp16 on a
card without bf16), the buckets at the Hugging Face Trainer's ``auto`` sizes (``reduce_bucket_size`` = hidden²,
prefetch 0.9 hidden², persistence 10 hidden: what most ZeRO fine-tunes run).

The collectives are rings: an all-gather or reduce-scatter of B bytes moves B x (n-1)/n per rank, an all-reduce
twice that, at the card's NVLink (or PCIe) rate within a node and ``NETWORK_BANDWIDTH`` between nodes
(``hardware/gpus.py``), at the host link's efficiency. FSDP2 all-gathers every unit in forward, and again in
backward when it reshards, for every micro-batch; it reduce-scatters once per step (sync on the last micro-batch)
or once per micro-batch; HSDP adds an all-reduce of the shards between nodes; DDP all-reduces the gradients once
per step. Offload adds, unhidden, each gathered shard over the host link (fp32, per gather), the sharded gradients
back, and the optimizer step on the host at ``HOST_STEP_BANDWIDTH``; ZeRO-Offload each micro-batch's fp32 gradient
partition to the host, the updated 16-bit partition back, the step on the host and, with ``offload_param``, each
gathered partition from the host in forward and backward. ZeRO, in the model's 16-bit dtype: stage 1
reduces the gradients once a step (at the last micro-batch) and stage 2 every micro-batch, each then all-gathers the
updated partitions (``allgather_bucket_size`` buckets, after the step: unhidden); their reductions are hidden behind
backward only with ``overlap_comm``; stage 3 gathers every block in forward and backward (prefetched: hidden) and
reduce-scatters every micro-batch. Left out: how the step overlaps these with its kernels (``search.py``), the
latency of many small buckets.
"""

from __future__ import annotations

from memfit.hardware.cluster import World
from memfit.hardware.gpus import NETWORK_BANDWIDTH, peer_link
from memfit.planner.cost import EFFICIENCY
from memfit.planner.mesh import MAX_SHARD
from memfit.techniques.parallel import mixed_dtypes
from memfit.techniques.recipe import Recipe
from memfit.techniques.zero_config import STAGES, ZeroConfig, resolve_auto

__all__ = ["structures", "zero_structures", "comm_seconds", "offload_seconds", "HOST_STEP_BANDWIDTH", "ADAMW_BYTES",
           "ENGINES", "ZERO_BUCKETS"]

#: the data-parallel engines a plan may search: PyTorch's own (DDP, FSDP2) and DeepSpeed's ZeRO
ENGINES = ("torch", "deepspeed")
#: the buckets a planned ZeRO stage is given: the Hugging Face Trainer's ``auto``, resolved from the hidden size (the
#: numbers written out, so the recipe and its ds_config.json say what was estimated)
ZERO_BUCKETS = ("reduce_bucket_size",)
_STAGE3_BUCKETS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def structures(card, world: World, has_blocks: bool, optimizer: str, engines=("torch",),
               hidden: int | None = None) -> list[dict]:
    """The recipe structures searched (without the micro-batch), likely fastest first: PyTorch's (DDP, FSDP2) where
    ``engines`` has ``torch``, DeepSpeed's ZeRO stages where it has ``deepspeed`` (``hidden``: the model's hidden
    size, for their buckets)."""
    found = _torch_structures(card, world, has_blocks, optimizer) if "torch" in engines else []
    return found + (zero_structures(card, world, has_blocks, optimizer, hidden) if "deepspeed" in engines else [])


def zero_structures(card, world: World, has_blocks: bool, optimizer: str, hidden: int | None = None) -> list[dict]:
    """DeepSpeed's ZeRO stages (module docstring), each with checkpointing off and, for a model of blocks, every
    block, and ZeRO-Offload's two (blocks checkpointed) where the optimizer steps on the host; none at one GPU.
    Buckets at the Trainer's ``auto`` sizes from ``hidden`` (DeepSpeed's defaults without it). An offload's host
    share is left off the GPU's figures by the trace (``techniques/deepspeed_offload.py``)."""
    if world.size == 1:
        return []
    precision = "bf16" if card is None or card.bf16 else "fp16"

    def buckets(keys) -> str:
        if not hidden:
            return ""
        return resolve_auto(ZeroConfig.from_values({key: "auto" for key in keys}), hidden).text

    stages = [("zero1", buckets(ZERO_BUCKETS)), ("zero2", buckets(ZERO_BUCKETS)),
              ("zero2", ",".join(filter(None, (buckets(ZERO_BUCKETS), "overlap_comm=true")))),
              ("zero3", buckets(_STAGE3_BUCKETS))]
    found = [{"parallel": stage, "precision": precision, "zero": zero, "checkpointing": checkpointing,
              "optimizer": optimizer}
             for checkpointing in (("off", "blocks") if has_blocks else ("off",)) for stage, zero in stages]
    if _host_step(optimizer):
        offloads = [("zero2", buckets(ZERO_BUCKETS), "offload_optimizer=cpu"),
                    ("zero3", buckets(_STAGE3_BUCKETS), "offload_optimizer=cpu,offload_param=cpu")]
        found += [{"parallel": stage, "precision": precision, "zero": ",".join(filter(None, (zero, offload))),
                   "checkpointing": "blocks" if has_blocks else "off", "optimizer": optimizer}
                  for stage, zero, offload in offloads]
    return found


def _host_step(optimizer: str) -> bool:
    """Whether ``optimizer`` can step on the host (an offload's): not a quantized, paged or fp8 one."""
    return not any(k in optimizer for k in ("8bit", "4bit", "paged", "fp8"))


def _torch_structures(card, world: World, has_blocks: bool, optimizer: str) -> list[dict]:
    """DDP and FSDP2's structures (module docstring)."""
    bf16 = card is None or card.bf16
    ddp = {"parallel": "ddp", "precision": "bf16-mixed" if bf16 else "fp32"}
    policy = {"mixed_precision": "bf16:fp32"} if bf16 else {}
    zero2 = {"parallel": "fsdp", "reshard_after_forward": "false", **policy}
    zero3 = {"parallel": "fsdp", **policy}
    # offloaded gradients are reduced every micro-batch: kept unsharded (sync on the last) they would
    # sit on the GPU whole, which is what offload is there to avoid
    offload = {**zero3, "offload": "cpu", "sync_grads": "every"}
    found = []
    host_step = _host_step(optimizer)
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
    if recipe.parallel in STAGES:
        return _zero_offload_seconds(recipe, world, params, micro_batches, card)
    if recipe.offload == "none":
        return 0.0
    link = card.host_link_bandwidth * EFFICIENCY["host_link"]
    shard = params * 4 / (world.gpus if recipe.shard_over == "node" else world.size)
    gathers = (1 + (recipe.reshard_after_forward != "false")) * micro_batches
    reduces = micro_batches if recipe.sync_grads == "every" else 1
    return (gathers + reduces) * shard / link + shard / 4 * ADAMW_BYTES / HOST_STEP_BANDWIDTH


def _zero_offload_seconds(recipe: Recipe, world: World, params: int, micro_batches: int, card) -> float:
    """ZeRO-Offload's host work a step, unhidden (module docstring): a rank's fp32 gradient partition to the host each
    micro-batch, its updated 16-bit partition back, AdamW on the host and, with ``offload_param``, each gathered
    16-bit partition from the host in forward and backward of every micro-batch."""
    zero = ZeroConfig.parse(recipe.zero)
    if zero.get("offload_optimizer") == "none":
        return 0.0
    link = card.host_link_bandwidth * EFFICIENCY["host_link"]
    share = params / world.size
    seconds = (micro_batches * share * 4 + share * 2) / link + share * ADAMW_BYTES / HOST_STEP_BANDWIDTH
    if zero.get("offload_param") != "none":
        seconds += 2 * micro_batches * share * 2 / link
    return seconds


def comm_seconds(recipe: Recipe, world: World, params: int, units: int, micro_batches: int, card) -> tuple[float, float]:
    """(seconds of collectives per step, seconds of one unit's all-gather) for one rank (module docstring)."""
    if world.size == 1:
        return 0.0, 0.0
    efficiency = EFFICIENCY["host_link"]
    within = peer_link(card)[1] * efficiency
    between = NETWORK_BANDWIDTH * efficiency
    if recipe.parallel in STAGES:
        return _zero_seconds(recipe, world, params, units, micro_batches, card)
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


def _zero_seconds(recipe: Recipe, world: World, params: int, units: int, micro_batches: int,
                  card) -> tuple[float, float]:
    """ZeRO's (hidden, unhidden) seconds of collectives a step (module docstring): rings over every rank in the
    model's 16-bit dtype."""
    n = world.size
    link = (NETWORK_BANDWIDTH if world.nodes > 1 else peer_link(card)[1]) * EFFICIENCY["host_link"]
    ring = params * 2 * (n - 1) / n / link  # one all-gather or reduce-scatter of every parameter
    zero = ZeroConfig.parse(recipe.zero)
    stage = STAGES[recipe.parallel]
    if stage == 3:  # every block gathered in forward and backward (prefetched) and reduced, each micro-batch
        overlapped = zero.get("overlap_comm") is not False
        reduce = ring * micro_batches
        return 2 * ring * micro_batches + reduce * overlapped, ring / max(units, 1) + reduce * (not overlapped)
    reduce = ring * (micro_batches if stage == 2 else 1)
    hidden = stage == 2 and zero.get("overlap_comm") is True
    # the updated partitions all-gathered after the step: nothing left to hide them behind
    return reduce * hidden, reduce * (not hidden) + ring
