"""What each kernel of a traced step computes and moves: the raw material of a step-time model.

An ``OpCounter`` hangs on the ledger (which calls it for every op it sees: a second dispatch
mode cost a quarter of a trace's time) and keeps one row per kernel: the ledger mark it ran under (phase, step, micro-batch), its FLOPs, the bytes it reads and
writes, and the dtype of its math. FLOPs come from torch's own formulas
(``torch.utils.flop_counter.flop_registry``: matmuls, convolutions, attention kernels); the CPU
flash-attention kernel that CUDA semantics traces stands in for CUDA's and is counted with CUDA's
formula. Bytes are the sizes of every tensor argument and result, which is what a memory-bound
kernel moves.

Written here rather than with ``FlopCounterMode`` because the planner needs the rows per phase and
in order (to line up traces of two micro-batch sizes op by op), and bytes, which it does not count.
Views are not kernels and are skipped; in-place ops are.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from memfit.accounting.events import plain

__all__ = ["OpCounter", "DTYPE_CODES", "is_view", "op_tensors"]

#: math dtype of a kernel, as a small int for numpy
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_aten = torch.ops.aten
_LIFT_FRESH = _aten.lift_fresh.default  # a fresh tensor's birth, aliasing by its schema
# allocation without a kernel, and views whose schema does not say so
_NOT_KERNELS = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                _aten.lift_fresh.default, _aten._unsafe_view.default, _aten._reshape_alias.default}
_TENSOR_TYPES = ("Tensor", "Tensor[]", "Tensor?", "Optional[Tensor]")
_ALIASES = {
    # CPU kernels CUDA semantics traces in place of CUDA's, counted with CUDA's formulas
    "_scaled_dot_product_flash_attention_for_cpu": _aten._scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _aten._scaled_dot_product_flash_attention_backward,
}


def _formula(func):
    packet = func.overloadpacket
    found = flop_registry.get(packet)
    if found is None and packet.__name__ in _ALIASES:
        found = flop_registry.get(_ALIASES[packet.__name__])
    return found


class OpCounter:
    """Rows of ``(mark, flops, bytes, dtype_code, scaled flops, scaled bytes)``, one per kernel.

    ``ledger``: the ledger whose marks say where the step is (``len(ledger.marks) - 1``).
    ``prime``: when the batch dimension is this prime, the FLOPs and the bytes of tensors whose
    element count is a multiple of it are those that scale with the batch (the last two columns;
    they are included in the totals).
    """

    def __init__(self, ledger, prime: int | None = None):
        self.ledger, self.prime = ledger, prime
        self.rows: list[tuple[int, int, int, int, int, int]] = []

    def __enter__(self):
        """Counts the kernels of the ops the ledger sees (one dispatch mode, not two)."""
        self.ledger.counter = self
        return self

    def __exit__(self, *exc):
        self.ledger.counter = None

    def record(self, func, args, kwargs, out) -> None:
        if func in _NOT_KERNELS or not _is_kernel(func):
            return
        # a DTensor's kernel runs on its local shard (tensor parallelism: 1/tp of a sharded matmul's FLOPs); the
        # arguments are rebuilt only when one is such a wrapper (most ops: one flatten, no rebuild)
        given = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        flat = [plain(t)[0] for t in given]
        if any(a is not b for a, b in zip(given, flat)):
            args, kwargs, out = tree_map(lambda v: plain(v)[0] if isinstance(v, torch.Tensor) else v,
                                         (args, kwargs, out))
        nbytes = sum(t.numel() * t.element_size() for t in flat)
        formula = _formula(func)
        flops = 0
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # an overload the formula does not know: count its bytes only
                flops = 0
        dtype = next((t.dtype for t in flat if t.is_floating_point()), torch.float32)
        scaled_flops = scaled_bytes = 0
        if self.prime:
            scaled_bytes = sum(t.numel() * t.element_size() for t in flat if t.numel() % self.prime == 0)
            scaled_flops = flops if flops % self.prime == 0 else 0
        self.rows.append((len(self.ledger.marks) - 1, flops, nbytes, DTYPE_CODES.get(dtype, 0), scaled_flops,
                          scaled_bytes))


_KERNELS: dict = {}  # op -> _is_kernel's answer (read off its schema once: every op of a trace asks)


def _is_kernel(func) -> bool:
    """A tensor result that is fresh memory or written in place (not a view, not metadata such
    as ``prim.device``); in-place foreach ops return nothing and are kernels."""
    known = _KERNELS.get(func)
    if known is None:
        known = _KERNELS[func] = _kernel_schema(func)
    return known


def _kernel_schema(func) -> bool:
    returns = func._schema.returns
    if not returns:
        return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
    return any(str(r.type) in _TENSOR_TYPES and (r.alias_info is None or r.alias_info.is_write) for r in returns)


_VIEWS: dict = {}


def is_view(func) -> bool:
    """An aten op whose every result is a view that writes nothing (``view``, ``t``, ``slice``...: ~30 % of a
    trace's ops): no kernel runs, so no kernel scratch to probe (``probe_worthy`` answers no for each)."""
    known = _VIEWS.get(func)
    if known is None:
        schema = func._schema
        # one tensor argument, and not an op that decomposes (``reshape``, ``contiguous``, ``pin_memory`` may copy:
        # composite, they reach this mode as the ops they decompose into, but a mode seeing one is told so here)
        known = _VIEWS[func] = (
            func.namespace == "aten" and func is not _LIFT_FRESH and bool(schema.returns)
            and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
            and sum("Tensor" in str(a.type) for a in schema.arguments) == 1
            and not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"))
    return known


def op_tensors(args, kwargs) -> list:
    """The tensors among an op's arguments: ``tree_flatten``'s, without its cost on every op of a trace (~4 % of
    one): aten's arguments are tensors, scalars and flat lists of them; anything nested goes through pytree."""
    out = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    out.append(item)
                elif isinstance(item, (list, tuple, dict)):
                    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        elif isinstance(value, dict):
            return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return out
