"""Fake kernels for CPU ops whose meta kernel follows CUDA's rules instead of the CPU's.

``aten._grouped_mm`` (the kernel behind ``torch.nn.functional.grouped_mm``, which Hugging Face's
default ``experts_implementation="grouped_mm"`` calls for every mixture-of-experts layer) has a
meta kernel that copies the CUDA checks: it refuses anything but bfloat16 ("Expected inputs of
BF16 type"). The CPU kernel of torch 2.13 runs in any float dtype, so on fake CPU tensors an fp32
or bf16-mixed Mixtral step failed although the real CPU step runs. Its output is a plain
contiguous ``torch.empty`` of the product's shape on a CPU build (the meta kernel pads strides only
``if torch.version.cuda``), which is what ``CpuKernels`` makes for non-bf16 operands; bf16 goes
to the meta kernel unchanged. ``tests/test_families.py`` checks Mixtral, Qwen2-MoE and Qwen3-MoE
steps against the CPU allocator. Nothing is registered with the dispatcher (``torch.library``):
``CpuKernels`` is a dispatch mode, active only while a trace runs (as a fake trace's: run inside
``estimator/fake.py``'s ``ScalarReads`` through ``handle``, one mode less on every op), so no kernel outlives it.

Routing. Which expert a token goes to is data: a fake tensor has no values, so the router's
choice is unknown. In this path it does not change what is allocated: every tensor of the experts
is sized by tokens x top_k, whatever the split (measured: forcing all tokens onto the same
experts or spreading them evenly gave byte-identical fp32 and bf16-mixed peaks). What does
depend on it is the scratch of the bfloat16 CPU kernel, which converts each expert's rows to fp32
(measured: 34 KiB of scratch for four groups of 32 rows, 82 KiB for one group of 128), so it grows
with the largest group. Kernel scratch is measured by replaying the call on real tensors
(``accounting/scratch.py``); ``probe_operands`` gives that replay the group offsets of the chosen
routing instead of zeros (which would skip every group):

- ``balanced`` (default): each expert gets tokens x top_k / experts rows, what load-balancing
  losses train routers towards;
- ``worst``: every token picks the same top_k experts, so top_k groups hold all the tokens.

The eager experts loop (``experts_implementation="eager"``) selects tokens with ``nonzero``, whose
output size is data, and is not traced on fake tensors: transformers 5.23 picks ``grouped_mm`` by
default on CPU and GPU.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import MemfitError
from memfit.scoped import rng_hop_rules

__all__ = ["CpuKernels", "ROUTINGS", "check_routing", "current_routing", "probe_operands", "routed_offsets"]

ROUTINGS = ("balanced", "worst")
# (routing, top_k) of the trace being made, read when its kernels are replayed for scratch.
_ROUTING: contextvars.ContextVar = contextvars.ContextVar("memfit_moe_routing", default=None)

_GROUPED_MM = torch.ops.aten._grouped_mm.default


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs) -> list[int]:
    """Output shape of ``_grouped_mm`` (``_create_grouped_mm_output_tensor`` in torch's metas)."""
    if a.dim() == 2 and b.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def check_routing(routing: str) -> str:
    if routing not in ROUTINGS:
        raise MemfitError(f"moe_routing={routing!r} is not a routing: use one of {', '.join(ROUTINGS)}")
    return routing


def current_routing() -> str:
    """The routing of the trace being made (``balanced`` outside one)."""
    state = _ROUTING.get()
    return "balanced" if state is None else state[0]


def routed_offsets(rows: int, experts: int, routing: str, top_k: int | None) -> list[int]:
    """Cumulative rows per expert (``grouped_mm``'s ``offs``) for ``rows`` = tokens x top_k."""
    if routing == "worst":
        k = min(top_k or 1, experts)
        counts = [rows // k + (i < rows % k) for i in range(k)] + [0] * (experts - k)
    else:
        counts = [rows // experts + (i < rows % experts) for i in range(experts)]
    return [sum(counts[: i + 1]) for i in range(experts)]


def probe_operands(func, args, kwargs):
    """``args, kwargs`` of a kernel replayed for its scratch, with routed group offsets for
    ``_grouped_mm`` while a trace with a routing is being made (unchanged otherwise)."""
    state = _ROUTING.get()
    if func is not _GROUPED_MM or state is None:
        return args, kwargs
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if offs is None:
        return args, kwargs
    rows = b.size(-2) if a.dim() == 2 and b.dim() == 2 else a.size(0)  # the grouped (token) dimension
    routed = torch.tensor(routed_offsets(rows, offs.size(0), *state), dtype=offs.dtype)
    if len(args) > 2:
        return (a, b, routed, *args[3:]), kwargs
    return args, {**kwargs, "offs": routed}


# the two matrices of each matmul op: real kernels refuse operands of two dtypes, torch's meta kernels do not
_MATMUL_OPERANDS = {torch.ops.aten.mm: (0, 1), torch.ops.aten.bmm: (0, 1), torch.ops.aten.addmm: (1, 2),
                    torch.ops.aten.baddbmm: (1, 2), torch.ops.aten.mv: (0, 1), torch.ops.aten.addmv: (1, 2)}


class CpuKernels(TorchDispatchMode):
    """Answers ops whose meta kernel rejects what the CPU kernel accepts, and holds the MoE
    routing that replays of its kernels follow (see module docstring)."""

    def __init__(self, routing: str = "balanced", top_k: int | None = None):
        super().__init__()
        self.state = (check_routing(routing), top_k)
        self._token = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # a compiled step runs under it; compiling is not part of the step

    def __enter__(self):
        self._token = _ROUTING.set(self.state)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ROUTING.reset(self._token)

    @contextlib.contextmanager
    def routed(self):
        """The routing its kernels' replays follow, without pushing the mode: for a mode that runs
        ``handle`` itself (``estimator/fake.py``'s ``ScalarReads``; one mode less on every op)."""
        token = _ROUTING.set(self.state)
        try:
            yield self
        finally:
            _ROUTING.reset(token)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.handle(func, args, kwargs)

    def handle(self, func, args, kwargs=None):
        """``func`` run as this mode runs it (the mode itself popped, as in ``__torch_dispatch__``)."""
        kwargs = kwargs or {}
        operands = _MATMUL_OPERANDS.get(func.overloadpacket)
        if operands is not None:
            first, second = (args[i] if i < len(args) else None for i in operands)
            if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and first.dtype != second.dtype:
                # the meta kernels skip the check every real kernel makes (a float32 batch into a bf16 model)
                raise RuntimeError(f"expected mat1 and mat2 to have the same dtype, but got: {first.dtype} != "
                                   f"{second.dtype}")
        if func is _GROUPED_MM:
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
            if a.device.type == "cpu" and a.dtype != torch.bfloat16:
                if a.dtype != b.dtype:
                    raise RuntimeError(f"grouped_mm needs operands of one dtype, got {a.dtype} and {b.dtype}")
                return torch.empty(_grouped_mm_shape(a, b, offs), dtype=out_dtype, device=a.device)
        return func(*args, **kwargs)


rng_hop_rules(CpuKernels)  # a compiled step's RNG operators run under it (``memfit.scoped``)
