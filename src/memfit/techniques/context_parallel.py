"""Context parallelism (``Recipe(cp=N)``): each row's sequence split over N ranks, attention run as a ring.

torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``), as torchtitan runs
it: around each micro-batch's forward and backward, the micro-batch's sequence buffers (token ids, labels,
positions) are sharded in place over the ``cp`` dimension of the run's mesh with torch's head-tail load balancer
(rank r keeps chunks r and 2N - 1 - r of 2N), and ``scaled_dot_product_attention`` becomes torch's ring
attention: each rank's queries meet every rank's keys and values (all-gathered once a layer, ``cp_rotate=
allgather``, torchtitan's default; or passed round the ring, ``alltoall``), the partial outputs merged by their
log-sum-exp in fp32, and in backward the key and value gradients passed round the ring. The CP ranks are
consecutive ranks of an FSDP2 group (``hardware.cluster.Layout``: shard = dp_shard x cp, torchtitan's
dp_shard_cp), so FSDP2 reduces their gradients; they read the same rows.

Written here, not taken from torch: one handler. torch's ring is registered for CUDA's attention kernels
(flash, memory-efficient, cuDNN); on a CPU, and in memfit's CUDA-semantics trace, attention runs the CPU flash
kernel (which saves what CUDA's flash kernel saves), which torch 2.13 has no context-parallel rule for.
``_ring`` registers torch's own ring (``_templated_ring_attention`` and its backward) for the CPU flash kernel
while the context is on, so the estimate (fake tensors) and a torchrun over gloo (the truth,
``bench/distributed/distributed.py``) run torch's ring, rotation and merging unchanged. The loss is the model's own on
labels shifted before sharding (``shift_labels``: the next token of a chunk's last one is on another rank).

Not yet (each an error naming it): cp with pp, tp, ep or float8; attention other than SDPA (eager attention would
multiply local queries by local keys); models without token ids (images); sequences the 2N chunks do not
divide. There is no GPU truth yet: on a GPU the ring runs CUDA's flash kernel, whose scratch the estimate
stands in for with the CPU kernel's (the report says so).
"""

from __future__ import annotations

import contextlib

from memfit.errors import MemfitError, shown
from memfit.techniques.degrees import check_degree, unchecked_pair

__all__ = ["check_cp", "cp_conflict", "context_parallel", "ROTATE", "UNCHECKED_ON_GPU"]

#: how each layer's keys and values reach the other ranks (torch's ``set_rotate_method``)
ROTATE = ("allgather", "alltoall")
#: the note an estimate with context parallel carries until a GPU run confirms it
UNCHECKED_ON_GPU = ("context parallel: torch's ring attention, checked against torchrun on gloo (CPU flash kernel); "
                    "not yet against a GPU, where the ring runs CUDA's flash kernel")

#: what context parallelism has not been checked with against real runs (each an error naming it)
_INCOMPATIBLE = (("attention", lambda r: r.attention == "eager"), ("pp", lambda r: r.pp > 1),
                 ("tp", lambda r: r.tp > 1), ("ep", lambda r: r.ep > 1),
                 ("chunked_loss", lambda r: r.chunked_loss), ("compile", lambda r: r.compile),
                 ("lora", lambda r: r.lora != "off"), ("offload", lambda r: r.offload != "none"),
                 ("float8", lambda r: r.float8 != "off"))


def check_cp(value) -> None:
    check_degree("cp", value, "a number of GPUs", "no context parallelism")


def cp_conflict(recipe) -> str | None:
    """The first technique ``recipe`` pairs with context parallelism that memfit has not checked, as one line."""
    if recipe.cp == 1:
        if recipe.cp_rotate != "allgather":
            return f"cp_rotate={recipe.cp_rotate} needs context parallelism: set cp to 2 or more"
        return None
    if recipe.parallel != "fsdp":
        return (f"cp={recipe.cp} needs parallel=fsdp: the sequence is split over ranks of an FSDP2 group, which "
                "reduces their gradients (--parallel fsdp)")
    return unchecked_pair(recipe, "cp", _INCOMPATIBLE)


def context_parallel(build, mesh) -> None:
    """Run each micro-batch of the step under torch's context parallelism over ``mesh["cp"]``."""
    from torch.utils._python_dispatch import _disable_current_modes

    config = getattr(build.model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention != "sdpa" and build.recipe.attention != "sdpa":  # (attention=sdpa sets it after this technique)
        raise MemfitError(f"cp={build.recipe.cp} needs attention=sdpa: context parallel turns torch's "
                          f"scaled_dot_product_attention into a ring, and this model runs {shown(attention)}; "
                          "use attention=sdpa (--attention sdpa)")
    with _disable_current_modes():
        cp_mesh = mesh["cp"]
    rotate = build.recipe.cp_rotate
    build.batch_contexts.append(lambda part: _sharded(part, cp_mesh, rotate))
    if hasattr(build.watch, "probe_ops"):  # an estimate's ledger: the CPU kernel's own buffers, at each ring step
        build.watch.probe_ops = build.watch.probe_ops | {"_scaled_dot_product_flash_attention_for_cpu",
                                                         "_scaled_dot_product_flash_attention_for_cpu_backward"}


@contextlib.contextmanager
def _sharded(part: dict, mesh, rotate: str):
    """``part``'s sequence buffers sharded over ``mesh`` (in place, for the ``with`` block) and attention a ring:
    torch's ``context_parallel`` with the labels shifted first and the positions made explicit, as torchtitan
    passes them."""
    import torch
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

    ids = part.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise MemfitError("cp needs a batch of token ids (input_ids of rows x tokens): context parallel splits their "
                          "sequence; use cp=1 for this model")
    cp = mesh.size()
    rows, length = ids.shape
    if length % (2 * cp):
        raise MemfitError(f"cp={cp} cuts each sequence into {2 * cp} chunks (torch's load balancing: two a rank) and "
                          f"seq_len={length} is not a multiple of {2 * cp}: use a seq_len that is")
    labels = part.get("labels", ids)
    # the next token of a chunk's last one lives on another rank: shift before sharding (torchtitan's labels)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    positions = part.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(rows, length).contiguous()
    ids = ids.clone()  # sharded in place: a fresh micro-batch each time, as a data loader hands one over
    buffers = [ids, shifted, positions]
    part.update(input_ids=ids, labels=shifted, shift_labels=shifted, position_ids=positions)
    with _ring(rotate) as calls, _not_packed(), torch_context_parallel(mesh, buffers=buffers,
                                                                       buffer_seq_dims=[1] * len(buffers),
                                                                       no_restore_buffers=set(buffers)):
        yield
    if not calls:  # the attention went round torch's ring nowhere: the sequence was split and nothing joined it
        raise MemfitError("cp: this model's attention never reached torch's ring attention (a mask, or a kernel other "
                          "than flash attention): context parallel would be wrong for it; use cp=1")


def _not_packed():
    """transformers reads a jump in the position ids (a rank's two chunks: 0-15 and 48-63) as the start of another
    packed document and masks attention between them (under checkpointing, without a cache); a rank's chunks are
    parts of one row: no such mask."""
    try:
        from transformers import masking_utils
    except ImportError:
        return contextlib.nullcontext()
    from memfit.scoped import patched

    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return patched(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


@contextlib.contextmanager
def _ring(rotate: str):
    """torch's ring attention registered for the CPU flash kernel, and ``rotate`` set, for the ``with`` block; it
    gives the list of the ring's calls."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    aten = torch.ops.aten
    handlers = cp_attention.custom_ops
    calls = []

    def counted(handler):
        def run(op_call, args, kwargs):
            calls.append(op_call)
            return handler(op_call, args, kwargs)
        return run

    # torch's own handlers (CUDA's flash and efficient kernels, which a CUDA-semantics trace may pick) counted too
    own = dict(handlers)
    added = {op: counted(handler) for op, handler in own.items()}
    added.update({aten._scaled_dot_product_flash_attention_for_cpu.default: counted(_ring_forward),
                  aten._scaled_dot_product_flash_attention_for_cpu_backward.default: counted(_ring_backward)})
    old_rotate = cp_attention._cp_options.rotate_method
    handlers.update(added)
    cp_attention.set_rotate_method(rotate)
    try:
        yield calls
    finally:
        for op in added:
            handlers.pop(op, None)
        handlers.update(own)
        cp_attention._cp_options.rotate_method = old_rotate


def _local(op_call, args, kwargs):
    """(the CP group, the op's local arguments by name) of a DTensor attention call."""
    from torch.distributed.tensor import DTensor

    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    names = [a.name for a in op_call._schema.arguments]
    named = dict(zip(names, info.local_args))
    named.update(info.local_kwargs)
    return info.compute_mesh, named


def _wrap(mesh, tensors):
    from torch.distributed.tensor import DTensor, Shard

    return tuple(DTensor.from_local(t, mesh, (Shard(2),), run_check=False) for t in tensors)


def _ring_forward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    mesh, named = _local(op_call, args, kwargs)
    if named.get("attn_mask") is not None:
        raise MemfitError("cp needs causal attention without a mask (torch's ring attention): this model passes one")
    q, k, v = named.pop("query"), named.pop("key"), named.pop("value")
    named.pop("attn_mask", None)
    if not named.get("is_causal"):  # torch's load balancing is for causal attention only
        raise MemfitError("cp needs causal attention (a decoder language model): torch's load-balanced ring runs "
                          "causal attention only; use cp=1 for this model")
    out = _templated_ring_attention(mesh.get_group(), 2, op_call, q, k, v, is_causal=named.pop("is_causal"), **named)
    return _wrap(mesh, out[:2])


def _ring_backward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention_backward

    mesh, named = _local(op_call, args, kwargs)
    named.pop("attn_mask", None)
    grad_out = named.pop("grad_out")
    out = _templated_ring_attention_backward(mesh.get_group(), 2, op_call, grad_out=grad_out, grad_out_name="grad_out",
                                             is_causal=named.pop("is_causal"), **named)
    return _wrap(mesh, out[:3])
