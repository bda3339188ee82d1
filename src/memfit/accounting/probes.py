"""Probe sites: the ops whose kernels may allocate scratch inside themselves, out of a dispatch-level trace's
sight, and the record the ledger keeps of each such call (``Site``) so that ``scratch.py`` can replay it alone
under the allocator and measure that scratch.

Which ops: those whose CPU kernels were seen allocating internally (oneDNN convolution and RNN kernels, bf16
matmul reorders, mixed-dtype casts, CPU flash attention on non-contiguous operands) and every custom op
(bitsandbytes, torchao), whose kernels are opaque. Left out: collectives and FSDP2's copy-in/out ops (they cannot
run alone), what the CUDA libraries add (``cuda_semantics.py``), and the measuring itself (``scratch.py``).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from memfit.accounting.events import SPIKE, Site

__all__ = ["MATMULS", "probe_worthy", "ProbeSites"]

# Collectives and FSDP2's copy-in/out ops: no kernel scratch to replay (they cannot run alone). A
# backend's own staging copies (gloo's) are not the step's: the truth leaves them out too
# (``distributed/truth.py``), as NCCL's buffers are outside the caching allocator.
_NOT_PROBED = ("c10d", "_c10d_functional", "_dtensor", "fsdp")


def probe_worthy(func, tensors) -> bool:
    """Ops whose CPU kernels were seen allocating internally (see TORCH-FACTS.md), and every
    custom op (bitsandbytes, torchao): their kernels are opaque to a dispatch-level trace."""
    if func.namespace in _NOT_PROBED:
        return False
    if func.namespace not in ("aten", "prim", "prims"):
        return True
    name = func.__name__
    if any(word in name for word in ("convolution", "mkldnn", "rnn", "lstm", "gru")):
        return True
    if name.startswith("_scaled_dot_product_flash_attention_for_cpu") and \
            not all(t.is_contiguous() for t in tensors):  # it copies such operands (context parallel's chunks)
        return True
    floats = {t.dtype for t in tensors if t.is_floating_point()}
    low = floats & {torch.bfloat16, torch.float16}
    # oneDNN reorders low-precision matmul operands; TensorIterator casts mixed-dtype inputs.
    return bool(low) and (name.split(".")[0] in MATMULS or len(floats) > 1)


MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_addmm_activation",
           "_grouped_mm"}  # bf16 grouped_mm converts each group to fp32: cpu_kernels.py


class ProbeSites:
    """The ledger's part that records a probe site: its op, its arguments' layout and records, its outputs'
    records and layouts, where in the step it ran (``Ledger``'s ``records``, ``events``, ``sites``, ``phase``,
    ``step`` and storage ids)."""

    def _add_site(self, func, args, kwargs, out_records, out_metas) -> None:
        flat, spec = tree_flatten((args, kwargs))
        key_parts, layout, arg_records = [], [], []
        for leaf in flat:
            if isinstance(leaf, torch.Tensor):
                meta = (tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.requires_grad)
                key_parts.append(meta)
                layout.append(("tensor", meta))
                arg_records.append(self._ids.get(leaf.untyped_storage()))
            else:
                key_parts.append(repr(leaf))
                layout.append(("value", leaf))
        key = (func, tuple(key_parts), torch.is_grad_enabled())  # oneDNN RNN sizes its workspace by grad mode
        site = Site(key, self.phase, self.step, self._module(), [func, spec, layout], arg_records,
                    out_records, out_metas)
        self.sites.append(site)
        self.events.append((SPIKE, len(self.sites) - 1))
