"""Expert parallelism (``Recipe(ep=N)``): each MoE layer's experts split over N ranks, tokens sent to them.

transformers' own expert parallelism (``transformers.distributed.expert_parallel``, 5.24 and later), as
``DistributedConfig(ep_size=N)`` applies it: the model's expert plan (``config.base_model_ep_plan``) shards the
stacked expert weights over the EP group (``grouped_gemm``: ``Shard(0)``, each rank keeping experts/N of them)
and gives the experts module an all-to-all dispatch (``ep_dispatch_experts``, ``AllToAllEP``): each rank sorts
its (token, expert) pairs by expert, sends each to the rank holding that expert, runs its own experts on what
it receives, and sends the results back. The EP group is N consecutive ranks of an FSDP2 group
(``hardware.cluster.Layout``: shard = efsdp x ep, as torchtitan's EP borrows from its dp_shard); FSDP2 shards
the dense blocks over the whole group and each layer's experts over ``efsdp`` (``shard_experts``, called by
``parallel.py`` before each block).

What a rank holds depends on the routing: the all-to-all's receive buffer, the experts' activations and
their gradients are as many rows as (token, expert) pairs that reach this rank's experts. A fake tensor has no
values, so the router's choice is the estimate's assumption (``moe_routing``, ``hardware/cpu_kernels.py``):
``balanced`` (each expert tokens x top_k / experts of every rank's pairs: each rank receives its own count),
``worst`` (every token of every rank picks the same top_k experts, experts 0 to top_k - 1: the EP ranks holding
them, rank 0 first, receive every rank's pairs, the others none; rank 0 is the one traced). ``RoutedAllToAll`` is ``AllToAllEP`` with one
change on fake tensors: the split sizes it reads back to the host (``tolist``, the layer's one device-to-host
read) are the routing's instead of the fake counts' (which have no values). A real run keeps transformers'
``AllToAllEP`` unchanged; ``route(model, routing)`` makes a real run's routers choose as the estimate assumes
(for the truth runs: it changes which experts learn, never the bytes).

Not yet (each one error): ep with tp or pp, models without an expert plan.
"""

from __future__ import annotations

import contextlib

from memfit.errors import MemfitError
from memfit.techniques.degrees import check_degree, unchecked_pair

__all__ = ["check_ep", "ep_conflict", "ep_plan", "expert_parallel", "shard_experts", "route", "routed_sizes"]

#: what expert parallelism has not been checked with against real runs (each an error naming it)
_INCOMPATIBLE = (("tp", lambda r: r.tp > 1), ("pp", lambda r: r.pp > 1), ("chunked_loss", lambda r: r.chunked_loss),
                 ("compile", lambda r: r.compile), ("lora", lambda r: r.lora != "off"),
                 ("offload", lambda r: r.offload != "none"),
                 ("optimizer", lambda r: any(k in str(r.optimizer) for k in ("8bit", "4bit", "paged"))))

#: the name memfit's dispatch is registered under in transformers' ``EPImplementationInterface``
IMPLEMENTATION = "memfit_routed_all_to_all"


def check_ep(value) -> None:
    check_degree("ep", value, "a number of GPUs", "no expert parallelism")


def ep_conflict(recipe) -> str | None:
    """The first technique ``recipe`` pairs with expert parallelism that memfit has not checked, as one line."""
    if recipe.parallel != "fsdp":
        return (f"ep={recipe.ep} needs parallel=fsdp: the experts are split over ranks of an FSDP2 group "
                "(--parallel fsdp)")
    return unchecked_pair(recipe, "ep", _INCOMPATIBLE)


def _library():
    try:
        from transformers.distributed import expert_parallel as library
    except ImportError:
        library = None
    if library is None or not hasattr(library, "AllToAllEP"):
        import transformers

        raise MemfitError(f"ep needs transformers' expert parallelism (transformers>=5.24; this is "
                          f"{transformers.__version__}): pip install -U transformers, or use ep=1")
    return library


def ep_plan(model, ep: int) -> dict:
    """The model's expert plan, every wildcard expanded to the module and parameter paths it names, checked
    against ``ep`` (one error naming the fix otherwise)."""
    import re

    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    plan = dict(getattr(config, "base_model_ep_plan", None) or {})
    if "ep_dispatch_experts" not in plan.values():
        raise MemfitError(f"ep={ep} needs a mixture-of-experts model with an expert plan (a transformers config's "
                          f"base_model_ep_plan) and {type(model).__name__} has none: use ep=1")
    experts = _experts_of(model)
    if experts is not None and experts % ep:
        raise MemfitError(f"ep={ep} does not divide the model's {experts} experts: each rank holds an equal number; "
                          "use an ep that divides them")
    prefix = getattr(model, "base_model_prefix", "")
    inner = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    patterns = [(re.compile(re.escape(inner + key).replace(r"\*", r"\d+")), style) for key, style in plan.items()]
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    # in the plan's order: the weights' entries come first and set each experts module's local count, which its
    # dispatch then reads when it is installed
    return {name: style for pattern, style in patterns for name in names if pattern.fullmatch(name)}


def _experts_of(model) -> int | None:
    """How many experts each MoE layer of ``model`` has (its config's count), None if it names none."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    return next((getattr(config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                 if isinstance(getattr(config, n, None), int)), None)


def expert_parallel(build, mesh) -> None:
    """Split each MoE layer's experts over ``mesh["ep"]`` with transformers' expert plan and memfit's dispatch
    (``RoutedAllToAll``); ``parallel.py`` then shards them over ``efsdp`` (``shard_experts``) and the rest over the
    FSDP2 group."""
    from torch.utils._python_dispatch import _disable_current_modes

    from memfit.hardware.cluster import Layout

    library = _library()
    _register(library)
    plan = ep_plan(build.model, build.recipe.ep)
    with _disable_current_modes():
        ep_mesh, tp_mesh = mesh["ep"], mesh["tp"]
        dp = mesh["replicate"].size() * mesh["efsdp"].size() * mesh["ep"].size()
        build.expert_mesh = (Layout.experts(mesh), dp)
    library.apply_expert_parallelism(build.model, ep_mesh, tp_mesh, plan, ep_implementation=IMPLEMENTATION)
    modules = dict(build.model.named_modules())
    build.experts = [modules[name] for name, style in plan.items() if style == "ep_dispatch_experts"]


def shard_experts(experts, build, reshard, policy, offload) -> None:
    """An expert-parallel MoE layer's experts (DTensors over the EP group) sharded over ``efsdp``, the copies of
    each expert in the FSDP2 group, before their block, as transformers' ``apply_fully_sharded_data_parallelism``
    and torchtitan do: the block's own ``fully_shard`` then leaves them alone. An expert's gradient sums every
    data-parallel rank's tokens (they reach it through the all-to-all), so it is divided by the data-parallel
    degree, not its group's size; FSDP2 applies such a factor with PREMUL_SUM, which gloo refuses, so the sum is
    reduced and divided locally (``set_force_sum_reduction_for_comms``) where there is a reduction at all."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh, dp = build.expert_mesh
    # fewer experts on a rank than copies to shard them over: FSDP2's dim-0 chunks would leave ranks holding
    # padding (Mixtral's 8 experts over ep=8 x efsdp=2: each rank a whole expert), so they shard on dim 1, as
    # torchtitan's apply_fsdp does
    local = getattr(experts, "num_experts", None)
    placement = (lambda _param: Shard(1)) if isinstance(local, int) and local < mesh.size(-1) else None
    fully_shard(experts, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload,
                shard_placement_fn=placement)
    experts.set_gradient_divide_factor(float(dp))
    force_sum = getattr(experts, "set_force_sum_reduction_for_comms", None)  # torch 2.13; NCCL takes PREMUL_SUM
    if mesh.size() > 1 and force_sum is not None:
        force_sum(True)


def routed_sizes(tokens: int, top_k: int, experts: int, ep: int, me: int, routing: str) -> list[list[int]]:
    """``[send, receive]``: the (token, expert) pairs EP rank ``me`` sends to each rank of its group and receives
    from each, when every rank routes ``tokens`` tokens to ``top_k`` of ``experts`` experts as ``routing`` says
    (``cpu_kernels.routed_offsets``: every rank routes alike)."""
    from memfit.hardware.cpu_kernels import routed_offsets

    offsets = routed_offsets(tokens * top_k, experts, routing, top_k)
    counts = [b - a for a, b in zip([0] + offsets[:-1], offsets)]
    local = experts // ep
    per_rank = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
    return [per_rank, [per_rank[me]] * ep]


@contextlib.contextmanager
def _sizes_read_back(sizes):
    """``FakeTensor.tolist`` answering ``sizes`` (``AllToAllEP``'s one host read of its split sizes) while the
    dispatch runs: the fake counts have no values to read (an estimate's ``item()`` reads 0)."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = FakeTensor.__dict__["tolist"]
    FakeTensor.tolist = lambda self: [list(row) for row in sizes]
    try:
        yield
    finally:
        FakeTensor.tolist = original


def _register(library) -> None:
    if IMPLEMENTATION in library.EPImplementationInterface._global_mapping:
        return

    class RoutedAllToAll(library.AllToAllEP):
        """transformers' ``AllToAllEP``; on fake tensors its split sizes are the assumed routing's."""

        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
            from torch._subclasses.fake_tensor import is_fake

            if not is_fake(hidden_states):
                return super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            from memfit.hardware.cpu_kernels import current_routing

            tokens, top_k = hidden_states.size(0), top_k_index.size(-1)
            if self.tp_mesh.size() > 1:
                raise MemfitError("ep with tp: memfit has not checked that pair against real runs yet; drop one")
            ep = self.ep_mesh.size()
            sizes = routed_sizes(tokens, top_k, self.num_local_experts * ep, ep, self.ep_mesh.get_local_rank(),
                                 current_routing())
            with _sizes_read_back(sizes):
                return super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)

    library.EPImplementationInterface.register(IMPLEMENTATION, RoutedAllToAll)


def route(model, routing: str = "balanced"):
    """Make a real run's routers choose as an estimate assumes (``moe_routing``): a pre-hook on every experts module
    overwrites the chosen experts in place, pair ``i`` of the flattened (token, slot) choices going to expert
    ``i mod experts`` (``balanced``) or ``i mod top_k`` (``worst``), as ``routed_offsets`` counts them. In place and
    through ``.data`` (the router's top-k saved it for backward): no allocation, so the run's bytes are the
    user's. For truth runs only: it changes which experts learn. Returns the hooks' handles."""
    import torch

    from memfit.hardware.cpu_kernels import check_routing

    check_routing(routing)
    experts = _experts_of(model)

    def pre(_module, args):
        index = args[1].data
        torch.arange(index.numel(), out=index.view(-1))
        index.remainder_(index.size(-1) if routing == "worst" else experts)

    return [module.register_forward_pre_hook(pre) for module in model.modules()
            if type(module).__name__.endswith("Experts") and experts is not None]
