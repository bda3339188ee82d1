"""CUDA semantics for a trace that runs on the CPU: what a GPU would allocate, without one.

A CPU build of torch cannot make fake CUDA tensors run a backward (the autograd engine asks the
CUDA runtime for the device; a CUDA build without a GPU fails the same way), so the step is traced
on fake CPU tensors and each place where CUDA allocates differently is modelled here, by the
rules torch itself uses on CUDA:

* **Autocast lists.** ``torch.autocast("cuda")`` runs more ops in fp32 than CPU autocast: layer,
  group and RMS norm, softmax / log-softmax / sum / cumsum (``fp32_set_opt_dtype``), exp, log, pow,
  rsqrt, upsampling, ... (``aten/src/ATen/autocast_mode.h``, ``AT_FORALL_FP32`` and
  ``AT_FORALL_FP32_SET_OPT_DTYPE``). While ``cuda_semantics()`` is active, those ops get an
  ``AutocastCPU`` kernel (``torch.library``) that does what the CUDA one does; ops CPU autocast
  already handles keep their kernel. The other way round, ops CPU autocast casts and CUDA autocast
  does not (``cpu_only_autocast_ops``, read from the dispatcher) run uncast: ``cross_entropy_loss``
  is fp32 on CPU, while on CUDA its ``log_softmax`` keeps the logits' dtype and only ``nll_loss``
  casts to fp32 (a bf16 log-probability matrix and an fp32 copy, instead of two fp32 ones). The
  registrations are removed on exit.
* **Fused dropout.** On CUDA ``dropout`` in training is the fused ``native_dropout`` kernel
  (``native/Dropout.cpp``, ``is_fused_kernel_acceptable``), which keeps a bool mask for backward (1
  byte an element); the CPU keeps its mask in the input's dtype. ``aten::dropout`` is routed to
  ``native_dropout`` (in-place and feature dropout are not fused on CUDA either and keep their path).
* **Attention kernels.** On CUDA, SDPA with dropout runs the flash or memory-efficient kernel (the
  dropout mask is regenerated from the RNG seed, never stored); the CPU picks the math path and
  materialises the S x S weights and mask. Under ``cuda_semantics()`` the backend CUDA would pick
  is chosen by CUDA's rules (``cuda_attention_kernel``, including the fused kernels' need for a mask
  whose last dimension has stride 1: a permuted mask runs the math path, with its dropout). A fused
  one is traced without dropout so the CPU takes its flash kernel, which saves what CUDA's flash /
  efficient kernels save; where the CPU flash kernel refuses the mask (it needs a gradient, as
  T5's learned position bias does) CUDA's memory-efficient kernel itself is traced (its meta kernel),
  with the mask's full-size gradient in backward. The math path is traced as the math path.
* **foreach optimizers.** ``torch.optim`` defaults to the foreach implementation when every
  parameter is a CUDA tensor; it allocates whole-model temporaries the per-tensor loop does not.
  ``optim.make_optimizer`` asks ``active()`` and passes ``foreach=True``.
* **cuBLAS workspaces.** Each thread that runs a matmul gets a workspace from the caching allocator
  (32 MiB on Hopper and newer, 8 MiB + 128 KiB before: ``gpus.py``); the forward thread and
  autograd's device thread are two. The ledger adds one at the first matmul of forward and of
  backward and keeps both.
* **No CPU scratch, no CPU RNG state.** oneDNN scratch replays and the CPU generator state that
  checkpointing saves are host memory on a GPU run, so they are not counted.
* **cuDNN's convolution workspaces.** A convolution's forward, its input-gradient and its weight-gradient
  calls each take a workspace from the caching allocator for as long as the call runs, sized by the engine
  cuDNN's heuristics pick (``torch.backends.cudnn.benchmark`` off, torch's default). No published rule
  gives that size; ``conv_workspaces`` follows the one measured on an H200 (cuDNN 9.19, TF32 on, torch's
  default; ``bench/gpu/cuda_outside.py``, 10 shapes x fp32/bf16 x 3 calls): twice the bytes the call
  writes — the output for the forward and the weight gradient (from the output gradient's size), the
  input for the input gradient — and none for 1x1 kernels (GEMM engines) or grouped/depthwise
  convolutions (torch's own kernels for most). Measured/rule over the 60 calls: 1,639 / 1,720 MiB, median
  |error| 4.2 MiB; the largest misses: ResNet-50's 7x7 stem (rule 196 MiB, measured 116-128), small bf16
  calls (a 5 MiB floor the rule does not have), and input gradients cuDNN computes without one.
* **The caching allocator.** Every request is rounded up to 512 bytes and served from cached
  segments (``accounting/cuda_allocator.py``): the replayed event stream gives
  ``max_memory_allocated`` and ``max_memory_reserved``, under the card's memory less its context,
  and the verdict (``estimator/verdict.py``).

Not modelled (measured where a GPU was lent; see README):

* cuDNN's RNN buffers, whose sizes cuDNN decides internally (no published rule): the workspace and
  reserve of ``_cudnn_rnn`` (``cudnnGetRNNTempSpaceSizes``; for the 2-layer LSTM of the zoo on an H100, a
  19,874,112-byte workspace in forward, backward-data and backward-weights and a 1,081,600-byte reserve
  kept from forward to backward, in fp32). On CPU the LSTM traces as oneDNN layers instead. Convolution
  workspaces with TF32 off or with ``cudnn.benchmark`` (which may pick engines with larger ones).
* Kernels' scratch freed inside one op: the memory-efficient attention backward's fp32 workspace
  (the size of grad_q, plus a row of fp32 per query), the reduction buffers of ``sum`` over many rows
  (a Linear's bias gradient), ``_safe_softmax``'s bool row mask.
* Autocast's lower-precision list beyond the ops CPU autocast already casts (``addmv``, ``einsum``,
  the RNN cells, ...).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings

import torch
from torch.utils._pytree import tree_map_only

from memfit.scoped import patched

__all__ = ["cuda_semantics", "cuda_attention_kernel", "cpu_only_autocast_ops", "active", "conv_workspaces"]

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
    "logsumexp", "rms_norm", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
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


def _has_autocast_kernel(qualified: str, key: str = "AutocastCPU") -> bool:
    name, _, overload = qualified.partition(".")
    full = f"aten::{name}" + (f".{overload}" if overload else "")
    return torch._C._dispatch_has_kernel_for_dispatch_key(full, key)


# CPU autocast's lower-precision ops that CUDA casts one level down (conv*.padding at ``convolution``,
# ``_addmm_activation`` after ``addmm``/``linear``, the RNN at ``_cudnn_rnn``, MHA at its linears): their
# CPU kernel stays. Every other op with a CPU autocast kernel and no CUDA one runs uncast on CUDA.
_CPU_CAST_KEPT = {"aten::conv1d.padding", "aten::conv2d.padding", "aten::conv3d.padding",
                  "aten::_addmm_activation", "aten::mkldnn_rnn_layer", "aten::_native_multi_head_attention"}


def cpu_only_autocast_ops() -> list[str]:
    """Ops CPU autocast casts and CUDA autocast does not (``cross_entropy_loss``: fp32 on CPU, while on
    CUDA its ``log_softmax`` keeps the input dtype and only ``nll_loss`` casts), from the dispatcher."""
    cpu = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
    cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    return sorted(cpu - cuda - _CPU_CAST_KEPT)


def _uncast_kernel(op, qualified: str):
    """Skip CPU autocast's kernel for this op only. A composite op runs its decomposition with autocast
    still on, so what it calls is cast as on CUDA (``cross_entropy_loss``: ``nll_loss`` in fp32); a
    kernel op runs uncast."""
    name, _, overload = qualified.partition(".")
    full = f"aten::{name}" + (f".{overload}" if overload else "")
    if torch._C._dispatch_has_kernel_for_dispatch_key(full, "CompositeImplicitAutograd"):
        def kernel(*args, **kwargs):
            return op.decompose(*args, **kwargs)
    else:
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
                return op(*args, **kwargs)
    return kernel


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
                if _has_autocast_kernel(qualified, "AutocastCUDA") and not _has_autocast_kernel(qualified):
                    lib.impl(qualified, make(op), "AutocastCPU")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": meant
            for full in cpu_only_autocast_ops():
                qualified = full.removeprefix("aten::")
                try:
                    op = _op(qualified)
                except AttributeError:
                    continue
                lib.impl(qualified, _uncast_kernel(op, qualified), "AutocastCPU")
        yield
    finally:
        lib._destroy()


def _fused_dropout(input, p, train):  # noqa: A002 (aten's argument name)
    """``aten::dropout`` as CUDA runs it (``native/Dropout.cpp``): in training, for 0 < p < 1, the fused
    ``native_dropout`` kernel, which keeps a bool mask (1 byte an element) for backward; the CPU draws
    its mask in the input's dtype and multiplies. Otherwise what ``_dropout_impl`` does."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype)


@contextlib.contextmanager
def _dropout_policy():
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("dropout", _fused_dropout, "CompositeImplicitAutograd")
        yield
    finally:
        lib._destroy()


def _last_dim_stride_after_cast(tensor: torch.Tensor, dtype) -> int:
    """``stride(-1)`` of ``tensor`` once autocast has cast it to ``dtype`` (``.to`` keeps the strides of a
    dense tensor and lays out any other contiguously)."""
    if tensor.is_floating_point() and tensor.dtype != dtype and not _dense(tensor):
        return 1
    return tensor.stride(-1)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether some order of ``tensor``'s dimensions is contiguous (``is_non_overlapping_and_dense``). By hand:
    torch's ``_prims_common.is_non_overlapping_and_dense_or_false`` defines a class as it runs, which dynamo
    (torch 2.11) cannot trace, so under ``compile=true`` every attention call broke the estimate's graph
    where the GPU's stays whole (Qwen3-0.6B on the H200: one graph there, a graph per piece of every layer in
    the estimate until dynamo's recompile limit, allocated 2.97 % low; 20 graphs for a 10-layer Qwen3)."""
    sizes, strides = tuple(tensor.shape), tuple(tensor.stride())
    if math.prod(sizes) < 2:
        return True
    expected = 1
    for stride, size in sorted(zip(strides, sizes)):  # by stride; a size-1 dimension's stride is free
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def cuda_attention_kernel(query, key, attn_mask, enable_gqa: bool, value=None) -> str:
    """The SDPA backend CUDA (sm80+) picks: "flash", "efficient" or "math".

    ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: flash needs fp16/bf16, head dim <= 256
    and no explicit mask; the memory-efficient kernel takes fp32 and masks but not grouped-query
    attention, so fp32 GQA (a Llama in fp32) falls to the math path and keeps the S x S weights. Both
    need the last dimension of q, k, v and of the mask contiguous (``check_last_dim_stride_equals_1_dense``;
    the CPU does not ask it of the mask): a mask made by a ``permute`` (T5's relative position bias,
    unless made contiguous) sends the call to the math path, with its dropout.
    """
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    tensors = [t for t in (query, key, value) if t is not None]
    if any(_last_dim_stride_after_cast(t, dtype) != 1 and t.size(-1) != 1 for t in tensors):
        return "math"
    if attn_mask is not None and _last_dim_stride_after_cast(attn_mask, dtype) != 1:
        return "math"
    if dtype in _LOW and attn_mask is None and query.size(-1) <= 256:
        return "flash"
    if enable_gqa and query.size(-3) != key.size(-3):
        return "math"
    return "efficient"


def _cpu_flash_takes_mask(query, key, attn_mask) -> bool:
    """Whether the CPU flash kernel accepts ``attn_mask`` (``sdp_utils_cpp.h``, ``check_attn_mask_shape``):
    no gradient, and a 2-D or 4-D shape broadcastable to (batch, heads, L, S)."""
    if attn_mask is None:
        return True
    if attn_mask.requires_grad and torch.is_grad_enabled():
        return False

    def fits(dim, target):
        return dim in (1, target)
    if not (fits(attn_mask.size(-2), query.size(-2)) and fits(attn_mask.size(-1), key.size(-2))):
        return False
    if attn_mask.dim() == 2:
        return True
    return attn_mask.dim() == 4 and fits(attn_mask.size(0), query.size(0)) and fits(attn_mask.size(1), query.size(1))


def _efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """CUDA's memory-efficient kernel itself (its meta kernel runs on fake CPU tensors), for calls the CPU
    flash kernel cannot stand in for. As ``attention.cpp`` prepares it: autocast's casts, a bool mask
    turned additive, a mask whose strides are not 8-aligned padded (``preprocess_mask``), expanded to
    (batch, heads, L, S); backward then makes the mask's gradient at that full size."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype

    def cast(t):
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
        query, key, value = cast(query), cast(key), cast(value)
        bias = attn_mask
        if bias is not None:
            if bias.dtype == torch.bool:
                bias = torch.where(bias, 0.0, torch.scalar_tensor(float("-inf"), dtype=query.dtype))
            else:
                bias = cast(bias)
            aligned = all(s % 8 == 0 for s in bias.stride()[:-1]) and bias.stride(-1) == 1
            if not aligned:
                last = bias.size(-1)
                bias = torch.nn.functional.pad(bias, (0, 8 - last % 8))[..., :last]
            bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, bias))
        return torch.ops.aten._scaled_dot_product_efficient_attention.default(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def _fused_attention(fused: bool = True):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        kernel = cuda_attention_kernel(query, key, attn_mask, enable_gqa, value) if fused else "math"
        if kernel == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                enable_gqa=enable_gqa)
        if kernel == "efficient" and not _cpu_flash_takes_mask(query, key, attn_mask):
            return _efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
        # CUDA's fused kernels keep no dropout mask and no weights; without dropout the CPU picks
        # its flash kernel, which saves what CUDA's flash / efficient kernels save.
        return original(query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)

    # torch's context parallel patches the function by its __name__ (``_distribute_function``): named otherwise, its
    # ring went on a stray attribute and attention ran on each rank's local chunks, unjoined
    sdpa.__name__ = sdpa.__qualname__ = original.__name__
    with patched(functional, "scaled_dot_product_attention", sdpa):
        yield


@contextlib.contextmanager
def cuda_semantics(fused_attention: bool = True):
    """Trace the step as a CUDA device would run it (see the module docstring). Every change to torch
    it makes (the ``AutocastCPU`` and ``dropout`` registrations, the SDPA function) is undone on exit.
    ``fused_attention`` False: the card has no flash / memory-efficient kernel (ROCm's RDNA3: ``amd.py``),
    so SDPA runs the math path."""
    token = _ACTIVE.set(True)
    try:
        with _autocast_policy(), _dropout_policy(), _fused_attention(fused_attention):
            yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def mps_semantics():
    """Trace the step as MPS runs it on a Mac (``hardware/mps.py``): autocast's fp32 lists as CUDA's (torch's MPS
    autocast registers the same policy kinds), SDPA's math path in training (MPS has no fused attention with a
    backward: ``_scaled_dot_product_attention_math``, the weights kept), dropout unfused (``is_fused_kernel_acceptable``
    is CUDA/XPU only: the mask kept in the input's dtype, as on the CPU), and the per-tensor optimizer loop (MPS is
    not among foreach's devices: ``cuda.active()`` stays False)."""
    with _autocast_policy(), _fused_attention(fused=False):
        yield


def card_semantics(card):
    """The tracing context for ``card`` (a catalog ``GPU``): MPS's on a Mac, CUDA's (ROCm's is CUDA's, but for
    attention where the card has no fused kernel) otherwise."""
    if card.vendor == "apple":
        return mps_semantics()
    if card.vendor == "amd":
        from memfit.hardware.amd import fused_attention

        return cuda_semantics(fused_attention(card))
    return cuda_semantics()


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def conv_workspaces(func, args, out) -> list[int]:
    """The cuDNN workspaces (bytes, one per cuDNN call, each freed when its call returns) of ``aten.convolution``
    or ``aten.convolution_backward`` called with ``args`` on CUDA, which returned ``out``: twice what each call
    writes (module docstring: the rule measured on an H200); none for 1x1 kernels, grouped convolutions or
    3-D ones (not measured)."""
    if func is torch.ops.aten.convolution.default:
        inp, weight, groups = args[0], args[1], args[8]
        writes = [_nbytes(out)]
    elif func is torch.ops.aten.convolution_backward.default:
        grad_out, inp, weight, groups, mask = args[0], args[1], args[2], args[9], args[10]
        writes = [size for wanted, size in ((mask[0], _nbytes(inp)), (mask[1], _nbytes(grad_out))) if wanted]
    else:
        return []
    if groups != 1 or weight.dim() not in (3, 4) or math.prod(weight.shape[2:]) <= 1 or not inp.is_floating_point():
        return []
    return [2 * size for size in writes]
