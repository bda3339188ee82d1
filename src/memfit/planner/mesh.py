"""The mesh dimensions ``plan`` searches beside data parallel (``ranks.plan_ranks``): which degrees of tensor and
expert parallel a model and a world allow, the structures each is tried with, and the seconds of its collectives
that the step cannot hide.

Tensor parallel as torchtitan runs it (sequence and loss parallel, FSDP2's bf16 policy, gradients reduced every
micro-batch), at degrees dividing the heads, the MLP width and a node (``MAX_TP``). Expert parallel for a mixture
of experts with an expert plan, at degrees dividing the experts and the FSDP2 group within a node (``MAX_EP``): the
experts split over the EP group, the dense blocks FSDP2-sharded over the whole group
(``techniques/expert_parallel.py``); each rank still reads its own rows (EP borrows data-parallel ranks). Routing
is the estimate's default, balanced.

Pipeline parallel as torchtitan runs it over several nodes (its 405B rows): 1F1B over stages cut as torchtitan cuts
them, each stage FSDP2-sharded over its data-parallel ranks with the bf16 policy, every block checkpointed, TP at
the largest degree searched, micro-batches of one row (``pp_structure``). A stage holds 1/pp of the weights, so its
FSDP2 collectives move 1/pp of the bytes; what it costs is the bubble and the point-to-point sends
(``pp_seconds``): a 1F1B step runs ``m + pp - 1`` slots of one micro-batch's stage time for ``m`` micro-batches, the
bubble fraction ``(pp - 1) / (m + pp - 1)``, and each micro-batch's hidden state crosses each stage boundary
forward and its gradient backward.

Context parallel for long sequences (``CP_FROM`` tokens and more) as torchtitan runs it: torch's ring attention over
cp ranks of each FSDP2 group (dp_shard x cp), the bf16 policy, each row's sequence in 2 x cp chunks; CP peers read
the same rows, so the data-parallel ranks that split the batch are size / cp. Its cost (``cp_seconds``): every
layer all-gathers the keys and values of its peers in forward, again in a checkpointed recompute, and in backward
both the all-gather and the reduce-scatter of their gradients, not hidden.
"""

from __future__ import annotations

from memfit.hardware.cluster import World
from memfit.hardware.gpus import peer_link
from memfit.planner.cost import EFFICIENCY
from memfit.techniques.parallel import mixed_dtypes
from memfit.techniques.recipe import Recipe

__all__ = ["MAX_SHARD", "MAX_TP", "MAX_EP", "MAX_PP", "tp_degrees", "tp_structures", "tp_seconds", "ep_degrees",
           "ep_structures", "ep_seconds", "expert_parameters", "pp_degrees", "pp_structure", "pp_seconds",
           "pp_world", "bubble", "MAX_CP", "CP_FROM", "cp_degrees", "cp_structures", "cp_seconds"]


#: ranks one FSDP group may span in a plan: a per-rank trace under the fake process group grows with
#: them (a tiny Llama: 2 s at 64 ranks, 8 s at 512, a minute at 4096), and a search makes dozens. Past
#: it, the groups searched are a node's (HSDP); a node has at most this many GPUs (NVL72 has 72).
MAX_SHARD = 128

#: the largest TP degree searched: TP's collectives run every layer, so it stays within an NVLink domain of 8
#: (H100 / H200 HGX boards; torchtitan's published rows use 8)
MAX_TP = 8


def tp_degrees(source, world: World) -> list[int]:
    """The TP degrees a plan searches for ``source`` on ``world``: those dividing the GPUs per node (at most
    ``MAX_TP``) and the model's heads and MLP width, where the model has a tensor-parallel plan memfit lays out."""
    from memfit.techniques.tensor_parallel import MODELLED_STYLES

    config = source.config
    plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not plan or any(style not in MODELLED_STYLES for style in plan.values()):  # MoE experts' styles: not yet
        return []
    sizes = [getattr(config, n, None) for n in ("num_attention_heads", "num_key_value_heads", "intermediate_size")]
    return [tp for tp in (2, 4, 8) if tp <= min(world.gpus, MAX_TP) and world.gpus % tp == 0
            and all(not isinstance(v, int) or v % tp == 0 for v in sizes)]


def tp_structures(card, world: World, tp: int, has_blocks: bool, optimizer: str) -> list[dict]:
    """FSDP2 x TP at ``tp`` as torchtitan runs it: sequence and loss parallel, FSDP2's bf16 policy where the card
    has it, gradients reduce-scattered every micro-batch (kept unsharded to the last, a 405B model's are 188 GiB
    a rank at tp=8); FSDP2 over the data-parallel ranks of a node (HSDP between nodes) or over every one."""
    policy = {"mixed_precision": "bf16:fp32"} if card is None or card.bf16 else {}
    base = {"parallel": "fsdp", "tp": tp, "sequence_parallel": True, "loss_parallel": True, "sync_grads": "every",
            **policy}
    dp = world.size // tp
    overs = ["node"] + (["world"] if world.nodes > 1 and dp <= MAX_SHARD else [])
    return [{**base, "shard_over": over, "checkpointing": checkpointing, "optimizer": optimizer}
            for checkpointing in (("off", "blocks") if has_blocks else ("off",)) for over in overs]


def tp_seconds(recipe: Recipe, rows: int, seq_len: int, hidden: int, layers: int, micro_batches: int, card) -> float:
    """Seconds of one rank's TP collectives per step, none hidden (no async TP): with sequence parallel each block
    all-gathers the residual stream before its attention and its MLP and reduce-scatters after them (without it,
    two all-reduces: the same bytes), in forward, again in a checkpointed block's recompute, and in backward;
    a ring moves (tp-1)/tp of the gathered ``rows x seq_len x hidden`` activation at the card's link."""
    if recipe.tp == 1:
        return 0.0
    dtypes = mixed_dtypes(recipe.mixed_precision)  # FSDP2's compute dtype, else autocast's or the weights'
    width = 2 if (dtypes and dtypes[0] != "fp32") or recipe.precision != "fp32" else 4
    gathered = rows * seq_len * hidden * width
    passes = 2 + (recipe.checkpointing != "off")  # forward, backward, recompute
    ring = gathered * (recipe.tp - 1) / recipe.tp / (peer_link(card)[1] * EFFICIENCY["host_link"])
    return layers * micro_batches * passes * 4 * ring


#: the largest EP degree searched: its all-to-alls run every MoE layer, so it stays within a node's NVLink
MAX_EP = 8


def _experts(config) -> int | None:
    config = getattr(config, "text_config", None) or config
    return next((getattr(config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                 if isinstance(getattr(config, n, None), int)), None)


def ep_degrees(source, world: World) -> list[int]:
    """The EP degrees a plan searches for ``source`` on ``world``: those dividing the model's experts and the GPUs
    of a node (an FSDP2 group under HSDP; at most ``MAX_EP``), where the model has an expert plan."""
    config = source.config
    plan = getattr(getattr(config, "text_config", None) or config, "base_model_ep_plan", None) or {}
    experts = _experts(config)
    if "ep_dispatch_experts" not in plan.values() or not experts:
        return []
    try:
        import transformers.distributed.expert_parallel  # noqa: F401 — transformers' EP (5.24 and later)
    except ImportError:
        return []
    return [ep for ep in (2, 4, 8) if ep <= min(world.gpus, MAX_EP) and world.gpus % ep == 0 and experts % ep == 0]


def ep_structures(card, world: World, ep: int, has_blocks: bool, optimizer: str) -> list[dict]:
    """FSDP2 x EP at ``ep``: FSDP2 resharding after forward with the bf16 policy where the card has it, the experts
    split over ``ep`` ranks of each FSDP2 group."""
    policy = {"mixed_precision": "bf16:fp32"} if card is None or card.bf16 else {}
    # over several nodes also FSDP2 over every rank: the experts' copies (efsdp) then span the nodes, where HSDP
    # leaves each rank its experts whole
    overs = ["node"] + (["world"] if world.nodes > 1 and world.size <= MAX_SHARD else [])
    return [{"parallel": "fsdp", "ep": ep, **policy, "shard_over": over, "checkpointing": checkpointing,
             "optimizer": optimizer}
            for checkpointing in (("off", "blocks") if has_blocks else ("off",)) for over in overs]


def ep_seconds(recipe: Recipe, rows: int, seq_len: int, hidden: int, moe_layers: int, top_k: int, micro_batches: int,
               card) -> float:
    """Seconds of one rank's EP all-to-alls per step, none hidden (transformers' dispatch waits on each): every MoE
    layer sends each (token, expert) pair's hidden state to its expert's rank and the result back, in forward, in
    a checkpointed block's recompute, and in backward (the gradients, the same bytes); balanced routing sends
    (ep-1)/ep of a rank's ``rows x seq_len x top_k`` pairs away, at the card's link."""
    if recipe.ep == 1:
        return 0.0
    dtypes = mixed_dtypes(recipe.mixed_precision)
    width = 2 if (dtypes and dtypes[0] != "fp32") or recipe.precision != "fp32" else 4
    pairs = rows * seq_len * top_k * hidden * width
    passes = 2 + (recipe.checkpointing != "off")  # forward, backward, recompute
    moved = pairs * (recipe.ep - 1) / recipe.ep / (peer_link(card)[1] * EFFICIENCY["host_link"])
    return moe_layers * micro_batches * passes * 2 * moved


def expert_parameters(model) -> int:
    """Parameters of ``model``'s experts (the weights its expert plan splits), 0 without one."""
    from memfit.errors import MemfitError
    from memfit.techniques.expert_parallel import ep_plan

    try:
        plan = ep_plan(model, 1)
    except MemfitError:
        return 0
    params = dict(model.named_parameters())
    return sum(params[name].numel() for name, style in plan.items() if name in params and style == "grouped_gemm")


#: the largest PP degree searched (torchtitan's published 405B rows use 8)
MAX_PP = 8


def pp_degrees(source, world: World, tp: int, global_batch_size: int) -> list[int]:
    """The PP degrees a plan searches at ``tp``: over several nodes only (a pipeline's point there is that each
    stage's FSDP2 group moves 1/pp of the weights), dividing the ranks, at most ``MAX_PP``, every stage at least two
    blocks, the data-parallel ranks dividing the global batch into at least pp rows each (1F1B's micro-batches)."""
    depth = source.depth or 0
    if world.nodes < 2:
        return []
    found = []
    for pp in (2, 4, 8):
        dp = world.size // (tp * pp)
        if pp <= MAX_PP and world.size % (tp * pp) == 0 and depth >= 2 * pp and global_batch_size % dp == 0 \
                and global_batch_size // dp >= pp:
            found.append(pp)
    return found


def pp_structure(card, tp: int, pp: int, optimizer: str) -> dict:
    """FSDP2 x TP x PP as torchtitan's 405B rows run it: 1F1B, FSDP2 over each stage's data-parallel ranks with the
    bf16 policy where the card has it, sequence and loss parallel with TP, every block checkpointed."""
    policy = {"mixed_precision": "bf16:fp32"} if card is None or card.bf16 else {}
    sequence = {"sequence_parallel": True, "loss_parallel": True} if tp > 1 else {}
    return {"parallel": "fsdp", "tp": tp, **sequence, "pp": pp, "pp_schedule": "1f1b", "shard_over": "world",
            "checkpointing": "blocks", "optimizer": optimizer, **policy}


def pp_world(world: World, tp: int, pp: int) -> World:
    """The data-parallel group of one stage (the mesh is pp x dp x tp, pp outermost): within a node while dp x tp
    ranks fit in one, else spread over nodes."""
    dp = world.size // (tp * pp)
    per_node = max(1, world.gpus // tp)
    return World(dp, 1) if dp <= per_node else World(per_node, dp // per_node)


def pp_seconds(recipe: Recipe, rows: int, seq_len: int, hidden: int, card, between_nodes: bool) -> float:
    """Seconds of one rank's point-to-point sends per step, not hidden: each micro-batch's hidden state (``rows x
    seq_len x hidden``, 1/tp of it under sequence parallel) sent to the next stage in forward and its gradient back,
    over the network where the stages sit on different nodes."""
    if recipe.pp == 1:
        return 0.0
    from memfit.hardware.gpus import NETWORK_BANDWIDTH

    dtypes = mixed_dtypes(recipe.mixed_precision)
    width = 2 if (dtypes and dtypes[0] != "fp32") or recipe.precision != "fp32" else 4
    sent = rows * seq_len * hidden * width / (recipe.tp if recipe.sequence_parallel else 1)
    link = (NETWORK_BANDWIDTH if between_nodes else peer_link(card)[1]) * EFFICIENCY["host_link"]
    return 2 * recipe.grad_accum_steps * sent / link


def bubble(pp: int, micro_batches: int) -> float:
    """1F1B's (and GPipe's) idle fraction of a step: ``(pp - 1) / (m + pp - 1)``."""
    return (pp - 1) / (micro_batches + pp - 1)


#: the largest CP degree searched: the ring runs every layer, so it stays within a node's NVLink
MAX_CP = 8
#: the shortest sequence CP is searched for: below it a row's activations fit beside FSDP2's shards on the cards in
#: the catalog, and CP would only add its ring's collectives (torchtitan's CP rows start at 32768 tokens a rank)
CP_FROM = 16384


def cp_degrees(source, world: World, seq_len, global_batch_size: int) -> list[int]:
    """The CP degrees a plan searches: for a sequence of ``CP_FROM`` tokens or more, dividing a node's GPUs (an FSDP2
    group under HSDP; at most ``MAX_CP``), cutting the sequence into 2 x cp equal chunks, the data-parallel ranks
    (size / cp) dividing the global batch; for a model with token ids and decoder blocks."""
    if not seq_len or seq_len < CP_FROM or not source.depth:
        return []
    return [cp for cp in (2, 4, 8) if cp <= min(world.gpus, MAX_CP) and world.gpus % cp == 0
            and seq_len % (2 * cp) == 0 and global_batch_size % (world.size // cp) == 0]


def cp_structures(card, world: World, cp: int, has_blocks: bool, optimizer: str) -> list[dict]:
    """FSDP2 x CP at ``cp``: FSDP2 with the bf16 policy where the card has it over each node (HSDP between nodes) or
    over every rank, torch's ring with its all-gather rotation."""
    policy = {"mixed_precision": "bf16:fp32"} if card is None or card.bf16 else {}
    overs = ["node"] + (["world"] if world.nodes > 1 and world.size <= MAX_SHARD else [])
    return [{"parallel": "fsdp", "cp": cp, **policy, "shard_over": over, "checkpointing": checkpointing,
             "optimizer": optimizer}
            for checkpointing in (("off", "blocks") if has_blocks else ("off",)) for over in overs]


def cp_seconds(recipe: Recipe, rows: int, seq_len: int, kv_width: int, layers: int, micro_batches: int, card) -> float:
    """Seconds of one rank's ring collectives per step, none hidden: each layer all-gathers (cp-1)/cp of the keys and
    values (``rows x seq_len x kv_width``, twice: K and V) in forward and a checkpointed recompute, and in backward
    all-gathers them again and reduce-scatters their gradients, at the card's link."""
    if recipe.cp == 1:
        return 0.0
    dtypes = mixed_dtypes(recipe.mixed_precision)
    width = 2 if (dtypes and dtypes[0] != "fp32") or recipe.precision != "fp32" else 4
    kv = 2 * rows * seq_len * kv_width * width
    passes = 3 + (recipe.checkpointing != "off")  # forward, backward's gather and reduce, recompute
    ring = kv * (recipe.cp - 1) / recipe.cp / (peer_link(card)[1] * EFFICIENCY["host_link"])
    return layers * micro_batches * passes * ring
