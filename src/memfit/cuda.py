"""CUDA semantics for a trace that runs on the CPU: what a GPU would allocate, without one.

A CPU build of torch cannot make fake CUDA tensors run a backward (the autograd engine asks the
CUDA runtime for the device; a CUDA build without a GPU fails the same way), so the step is traced
on fake CPU tensors and each place where CUDA allocates differently is modelled here, by the
rules torch itself uses on CUDA:

* **Autocast lists.** ``torch.autocast("cuda")`` runs more ops in fp32 than CPU autocast: layer
  and group norm, softmax / log-softmax / sum / cumsum (``fp32_set_opt_dtype``), exp, log, pow,
  rsqrt, ... (``aten/src/ATen/autocast_mode.cpp``, ``AT_FORALL_FP32`` and
  ``AT_FORALL_FP32_SET_OPT_DTYPE``). While ``cuda_semantics()`` is active, those ops get an
  ``AutocastCPU`` kernel (``torch.library``) that does what the CUDA one does; ops CPU autocast
  already handles keep their kernel. The registrations are removed on exit.
* **Attention kernels.** On CUDA, SDPA with dropout runs the flash or memory-efficient kernel (the
  dropout mask is regenerated from the RNG seed, never stored); the CPU picks the math path and
  materialises the S x S weights and mask. Under ``cuda_semantics()`` the backend CUDA would pick
  is chosen by CUDA's rules (``cuda_attention_kernel``); a fused one is traced without dropout so
  the CPU takes its flash kernel, which saves what CUDA's save (output and a fp32 log-sum-exp per
  row), and the math path is traced as the math path.
* **foreach optimizers.** ``torch.optim`` defaults to the foreach implementation when every
  parameter is a CUDA tensor; it allocates whole-model temporaries the per-tensor loop does not.
  ``optim.make_optimizer`` asks ``active()`` and passes ``foreach=True``.
* **cuBLAS workspaces.** Each thread that runs a matmul gets a workspace from the caching allocator
  (32 MiB on Hopper and newer, 8 MiB + 128 KiB before: ``gpus.py``); the forward thread and
  autograd's device thread are two. The ledger adds one at the first matmul of forward and of
  backward and keeps both.
* **No CPU scratch, no CPU RNG state.** oneDNN scratch replays and the CPU generator state that
  checkpointing saves are host memory on a GPU run, so they are not counted.
* **The caching allocator.** Every request is rounded up to 512 bytes and served from cached
  segments (``accounting/cuda_allocator.py``): the replayed event stream gives
  ``max_memory_allocated`` and ``max_memory_reserved``.

Not modelled (measured where a GPU was lent; see README): cuDNN convolution and RNN workspaces,
the kernels' own backward scratch (flash attention's fp32 accumulators), and autocast's
lower-precision list beyond the ops CPU autocast already casts.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["cuda_semantics", "cuda_attention_kernel", "active", "allocator_stats"]

_ACTIVE = contextvars.ContextVar("memfit_cuda_semantics", default=False)

# torch's CUDA autocast, aten/src/ATen/autocast_mode.cpp (AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE)
FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp",
)
FP32_SET_OPT_DTYPE_OPS = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                          "linalg_vector_norm", "linalg_matrix_norm", "sum", "sum.dim_IntList")

_LOW = (torch.float16, torch.bfloat16)
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def active() -> bool:
    """True while a step is being traced with CUDA semantics."""
    return _ACTIVE.get()


def _up(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in _LOW else tensor


def _op(qualified: str):
    name, _, overload = qualified.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def _fp32_kernel(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            args, kwargs = tree_map_only(torch.Tensor, _up, (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _set_opt_dtype_kernel(op):
    names = [a.name for a in op._schema.arguments]
    where = names.index("dtype")
    positional = not op._schema.arguments[where].kwarg_only

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.is_floating_point() and first.dtype != torch.float64:
                if positional and len(args) > where:
                    if args[where] is None:
                        args = (*args[:where], torch.float32, *args[where + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return kernel


def _has_cpu_autocast_kernel(qualified: str) -> bool:
    name, _, overload = qualified.partition(".")
    full = f"aten::{name}" + (f".{overload}" if overload else "")
    return torch._C._dispatch_has_kernel_for_dispatch_key(full, "AutocastCPU")


@contextlib.contextmanager
def _autocast_policy():
    lib = torch.library.Library("aten", "IMPL")
    try:
        for names, make in ((FP32_OPS, _fp32_kernel), (FP32_SET_OPT_DTYPE_OPS, _set_opt_dtype_kernel)):
            for qualified in names:
                try:
                    op = _op(qualified)
                except AttributeError:  # an op this torch does not have
                    continue
                if not _has_cpu_autocast_kernel(qualified):
                    lib.impl(qualified, make(op), "AutocastCPU")
        yield
    finally:
        lib._destroy()


def cuda_attention_kernel(query, key, attn_mask, enable_gqa: bool) -> str:
    """The SDPA backend CUDA (sm80+) picks: "flash", "efficient" or "math".

    ``torch/csrc/.../sdp_utils.cpp``: flash needs fp16/bf16, head dim <= 256 and no explicit mask;
    the memory-efficient kernel takes fp32 and masks but not grouped-query attention, so fp32
    GQA (a Llama in fp32) falls to the math path and keeps the S x S weights.
    """
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    if dtype in _LOW and attn_mask is None and query.size(-1) <= 256:
        return "flash"
    if enable_gqa and query.size(-3) != key.size(-3):
        return "math"
    return "efficient"


@contextlib.contextmanager
def _fused_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if cuda_attention_kernel(query, key, attn_mask, enable_gqa) == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                enable_gqa=enable_gqa)
        # CUDA's fused kernels keep no dropout mask and no weights; without dropout the CPU picks
        # its flash kernel, which saves what CUDA's flash / efficient kernels save.
        return original(query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def cuda_semantics():
    """Trace the step as a CUDA device would run it (see the module docstring)."""
    token = _ACTIVE.set(True)
    try:
        with _autocast_policy(), _fused_attention():
            yield
    finally:
        _ACTIVE.reset(token)


def allocator_stats(ledger, *, expandable_segments: bool = False):
    """Replay a CUDA-semantics ledger's allocations through the caching-allocator model."""
    from memfit.accounting.cuda_allocator import CachingAllocator
    from memfit.accounting.ledger import ALLOC, FREE

    allocator = CachingAllocator(expandable_segments=expandable_segments)
    handles: dict[int, int] = {}
    records = ledger.records
    for kind, index in ledger.events:
        if kind == ALLOC:
            record = records[index]
            if record.donor is not None:  # in-place accumulation: the donor's block, renamed
                handles[index] = handles.pop(record.donor)
            else:
                handles[index] = allocator.malloc(record.nbytes)
        elif kind == FREE:
            if records[index].donated or index not in handles:
                continue
            allocator.free(handles.pop(index))
    return allocator.stats
