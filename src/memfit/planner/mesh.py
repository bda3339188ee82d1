"""The mesh dimensions ``plan`` searches beside data parallel (``ranks.plan_ranks``): which degrees of tensor and
expert parallel a model and a world allow, the structures each is tried with, and the seconds of its collectives
that the step cannot hide.

Tensor parallel as torchtitan runs it (sequence and loss parallel, FSDP2's bf16 policy, gradients reduced every
micro-batch), at degrees dividing the heads, the MLP width and a node (``MAX_TP``). Expert parallel for a mixture
of experts with an expert plan, at degrees dividing the experts and the FSDP2 group within a node (``MAX_EP``): the
experts split over the EP group, the dense blocks FSDP2-sharded over the whole group
(``techniques/expert_parallel.py``); each rank still reads its own rows (EP borrows data-parallel ranks). Routing
is the estimate's default, balanced.
"""

from __future__ import annotations

from memfit.hardware.cluster import World
from memfit.hardware.gpus import peer_link
from memfit.planner.cost import EFFICIENCY
from memfit.techniques.parallel import mixed_dtypes
from memfit.techniques.recipe import Recipe

__all__ = ["MAX_SHARD", "MAX_TP", "MAX_EP", "tp_degrees", "tp_structures", "tp_seconds", "ep_degrees", "ep_structures",
           "ep_seconds", "expert_parameters"]


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
