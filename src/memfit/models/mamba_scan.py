"""Mamba's sequential scan, collapsed on fake tensors into what it allocates.

Without the ``mamba_ssm`` CUDA kernels (always, on CPU), transformers runs Mamba's selective scan
as a Python loop over the sequence (``mamba_selective_scan``): per token a state update
``s = dA[:, :, t] * s + dBu[:, :, t]`` and an output ``s @ C[:, t]``, and in backward per token
three ``select_backward`` calls that each write a full-size zero tensor. Traced op by op that is
~25 dispatches per token and layer: mamba-1.4b at 2048 tokens took 719 s. The loop's memory is
regular, so on fake tensors ``collapsed_scans()`` swaps it for one autograd function that
allocates, in the same order, what the loop holds at the moments that can be a peak:

forward   the zero initial state, then the L states (saved for backward; one tensor, the same
          bytes), the mul temporary of the last step, the L per-token outputs and their
          ``torch.stack`` (the outputs list dies when the function returns);
backward  the outputs' gradient is read; the gradient buffers of ``C`` (B, L, N), ``dBu`` and
          ``dA`` (B, D, L, N each) are made (the first ``select_backward`` of each becomes the
          engine's accumulation buffer), the last state is released (its only users ran), and the
          second token's fresh ``select_backward`` tensors (one of ``C``'s shape, two of ``dA``'s)
          come and go: from then on each step only frees states, so that is the scan's highest
          point.

Per-token (B, D, N) temporaries of backward are left out (a 1/L share of one buffer). Measured
against the real loop on the CPU allocator (a 2-block Mamba, d_inner 128, N 8): fp32 -0.15% at
32 tokens, byte-exact at 128; bf16-mixed +0.22% and +0.08%; ``tests/test_families.py`` checks
both sizes. mamba-1.4b at 2048 tokens, ``fast=False``: 719 s before, ~13 s of CPU after. The
real run is never collapsed (a real tensor runs the loop), and neither is Mamba2, whose scan is
chunked and vectorised already.

Left out: the ``mamba_ssm`` CUDA kernels (a fused scan that saves no per-token states) are what a
GPU with them installed runs; this models the loop that runs without them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["collapsed_scans"]


class _Scan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dA, dBu, C, input_dtype):
        b, d, length, n = dA.shape
        device = dA.device
        s0 = torch.zeros(b, d, n, dtype=input_dtype, device=device)
        state_dtype = torch.promote_types(torch.promote_types(dA.dtype, input_dtype), dBu.dtype)
        out_dtype = torch.promote_types(input_dtype, C.dtype)
        if torch.is_autocast_enabled("cpu"):  # the matmul runs in autocast's dtype
            out_dtype = torch.get_autocast_dtype("cpu")
        cast = out_dtype != state_dtype  # s.to(input_dtype) or autocast's cast, saved by the matmul

        def states(count):  # ``count`` states and, where the matmul reads a cast, their casts
            shape = (b, d, count, n) if count > 1 else (b, d, n)
            made = [torch.empty(shape, dtype=state_dtype, device=device)]
            return made + [torch.empty(shape, dtype=out_dtype, device=device)] if cast else made

        early = states(length - 2)  # s_1 .. s_{L-2}
        second_last = states(1)  # s_{L-1}
        step = torch.empty(b, d, n, dtype=state_dtype, device=device)  # dA_t * s, freed after the add
        last = states(1)  # s_L
        del step
        outputs = torch.empty(b, d, length, dtype=out_dtype, device=device)  # the L (B, D, 1) matmul outputs
        y = torch.empty(b, d, length, dtype=out_dtype, device=device)  # torch.stack
        del outputs
        ctx.held = [s0, early, second_last, last, dA, C]
        ctx.dtypes = (dA.dtype, dBu.dtype, C.dtype)
        final = last[0]
        ctx.mark_non_differentiable(final)
        return y, final

    @staticmethod
    def backward(ctx, grad_y, _grad_last):
        dA = ctx.held[4]
        b, d, length, n = dA.shape
        device = dA.device
        a_dtype, u_dtype, c_dtype = ctx.dtypes
        grad_c = torch.empty(b, length, n, dtype=c_dtype, device=device)
        grad_u = torch.empty(b, d, length, n, dtype=u_dtype, device=device)
        grad_a = torch.empty(b, d, length, n, dtype=a_dtype, device=device)
        ctx.held[2] = ctx.held[3] = None  # the last two states: every user of them has run
        fresh = [torch.empty(b, length, n, dtype=c_dtype, device=device),
                 torch.empty(b, d, length, n, dtype=u_dtype, device=device)]
        del fresh
        fresh = torch.empty(b, d, length, n, dtype=a_dtype, device=device)
        del fresh
        ctx.held = None
        return grad_a, grad_u, grad_c, None


def _collapsed(original):
    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, **kwargs):
        if not isinstance(hidden_states, FakeTensor) or kwargs.get("use_mambapy"):
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state, **kwargs)
        # The same preamble as transformers' mamba_selective_scan (modeling_mamba.py, 5.23).
        input_dtype = hidden_states.dtype
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        B = B.transpose(1, 2)
        C = C.transpose(1, 2)
        discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
        discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
        deltaB_u = discrete_B * hidden_states[:, :, :, None].float()
        del discrete_B
        scan_output, ssm_state = _Scan.apply(discrete_A, deltaB_u, C, input_dtype)
        del deltaB_u, discrete_A
        if D is not None:
            scan_output = scan_output + hidden_states * D[None, :, None]
        if z is not None:
            scan_output = scan_output * F.silu(z)
        return (scan_output, ssm_state) if return_last_state else scan_output

    return scan


@contextlib.contextmanager
def collapsed_scans():
    """While active, Mamba's sequential scan on fake tensors is the collapsed one."""
    try:
        from transformers.models.mamba import modeling_mamba
    except ImportError:  # pragma: no cover - transformers is optional
        yield
        return
    original = modeling_mamba.mamba_selective_scan
    modeling_mamba.mamba_selective_scan = _collapsed(original)
    try:
        yield
    finally:
        modeling_mamba.mamba_selective_scan = original
