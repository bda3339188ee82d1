"""torchao's low-bit AdamW (8-bit, 4-bit, FP8 state) on fake tensors: what its compiled step allocates.

torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` keep each moment of a parameter of at least
4096 values (a whole number of blocks) as a tensor subclass: ``codes`` (uint8 of the parameter's
shape; 4-bit: two codes a byte, flattened; FP8: float8_e4m3fn), one fp32 ``scale`` per block (256
values; 4-bit: 128) and, for 8/4-bit, a fp32 lookup table ``qmap`` (256 / 16 entries) per moment.
Smaller parameters keep plain moments of their own dtype. On fake tensors that state is made by
torchao's own code, so its bytes are exact by construction.

The step is torchao's ``single_param_adam`` compiled by ``torch.compile`` (Inductor) once per
parameter shape; a compiled kernel cannot run on fake tensors, so while a fake step runs
``torch.compile`` hands back a stand-in that allocates, per quantised parameter of N values in K
blocks, what the compiled kernel allocates (two of each: one per moment), in its order:

    8-bit  +scale(K fp32) +moment(N fp32) -scale -moment
    4-bit  +nibbles(N/2 uint8) +codes(N uint8) -nibbles +scale(K fp32) +moment(N fp32)
           +index(N int64) -codes -scale -moment -index
    FP8    +scale(K fp32) +fp8(N float8) -scale -fp8   below 256 blocks
           +scale(K fp32) -scale                        from 256 blocks on

and nothing for a plain parameter (Inductor fuses its update into one loop). Read from the CPU
allocator's events of the compiled step (torch 2.13 CPU on 2 threads, torchao 0.18; fp32 and bf16
parameters, 1-D and 2-D; 8/4-bit: 4 096 to 524 288 values, the same pattern at every size; FP8:
the new codes are a buffer at 4 096, 8 192 and 32 768 values and are written in place at 65 536 and
more, so 32 768 < N < 65 536 is assumed, not measured); ``tests/test_lowbit.py`` compiles the real
step and checks the estimate against the allocator. So 4-bit AdamW's step holds 26 bytes per value
of its largest parameter at its peak (its quantiser searches the table with int64 indices): more
than 8-bit's 8 and FP8's 0 to 2, which can make the 4-bit step peak above the 8-bit one although
its state is half.

Known limitations: the pattern is the CPU kernel's; Inductor's CUDA (Triton) kernels may fuse more
(not yet measured on a GPU: ``python -m bench optimizers measure``; torchao's published ViT-H peaks,
where the peak is not in the step, agree within 1.0 %: ``bench/published/published.py``), and Inductor's CPU
choices may change with the thread count. ``amsgrad`` and ``bf16_stochastic_round``
(off in memfit's optimizers) add buffers not modelled here. Written by hand because nothing in torch
or torchao says what a compiled kernel will allocate without compiling and running it.
"""

from __future__ import annotations

import torch

__all__ = ["lowbit_optimizer", "LOWBIT"]

#: memfit name -> (torchao.optim class, values per scale block): torchao's defaults, and the 4-bit
#: block of 256 that transformers' Trainer passes for optim="adamw_torch_4bit"
LOWBIT = {"ao_adamw8bit": ("AdamW8bit", 256), "adamw4bit": ("AdamW4bit", 128), "hf_adamw4bit": ("AdamW4bit", 256),
          "ao_adamw_fp8": ("AdamWFp8", 256)}

# what the compiled step allocates per quantised moment: name -> (numel from (N, K), dtype)
_BUFFERS = {
    "scale": (lambda n, k: k, torch.float32),  # the moment's new block scales
    "moment": (lambda n, k: n, torch.float32),  # the moment dequantised and updated in fp32
    "nibbles": (lambda n, k: n // 2, torch.uint8),  # 4-bit: high and low halves of each code byte
    "codes": (lambda n, k: n, torch.uint8),  # 4-bit: the codes unpacked, one a byte
    "index": (lambda n, k: n, torch.int64),  # 4-bit: the new codes as int64 table indices
    "fp8": (lambda n, k: n, torch.float8_e4m3fn),  # FP8: the new codes, when not written in place
}
FP8_IN_PLACE_BLOCKS = 256  # from this many blocks on, Inductor writes FP8 codes in place (above)
_PROGRAMS = {  # by state subclass name: "+x" allocates both moments' x, "-x" frees them
    "OptimState8bit": ("+scale", "+moment", "-scale", "-moment"),
    "OptimState4bit": ("+nibbles", "+codes", "-nibbles", "+scale", "+moment", "+index", "-codes", "-scale",
                       "-moment", "-index"),
    "OptimStateFp8": ("+scale", "+fp8", "-scale", "-fp8"),
    "OptimStateFp8 in place": ("+scale", "-scale"),
}


def _kernel_standin(p, grad, step, exp_avg, exp_avg_sq, *args, **kwargs) -> None:
    """What the compiled ``single_param_adam`` allocates and frees for ``p``; nothing is computed
    (the values of fake tensors do not exist)."""
    kind = type(exp_avg).__name__
    n = p.numel()
    k = n // getattr(exp_avg, "block_size", 1)
    if kind == "OptimStateFp8" and k >= FP8_IN_PLACE_BLOCKS:
        kind += " in place"
    program = _PROGRAMS.get(kind, ())
    live: dict[str, list] = {}
    for op in program:
        name = op[1:]
        if op[0] == "+":
            numel, dtype = _BUFFERS[name]
            # new_empty from the parameter: the ledger gives the buffers the parameter's owner
            live[name] = [p.new_empty(numel(n, k), dtype=dtype) for _ in range(2)]
        else:
            del live[name]


def _compile(fn=None, **kwargs):
    from torchao.optim.adam import single_param_adam

    if fn is not single_param_adam:
        raise RuntimeError(f"torchao's step compiles {getattr(fn, '__name__', fn)!r}, not single_param_adam: "
                           "this torchao's step is not modelled")
    return _kernel_standin


class _FakeStep:
    """Mixed into a torchao optimizer: on fake tensors its step runs torchao's own loop (state made
    by torchao) with the compiled kernel replaced by what it allocates; on real tensors, torchao's."""

    def step(self, closure=None):
        from torch._subclasses.fake_tensor import FakeTensor

        from memfit.scoped import patched

        params = [p for g in self.param_groups for p in g["params"]]
        if not any(isinstance(p, FakeTensor) for p in params):
            return super().step(closure)
        with patched(torch, "compile", _compile):
            return super().step(closure)


_CLASSES: dict[str, type] = {}


def _warm_tables() -> None:
    """torchao builds its 8/4-bit lookup tables from real tensors (``.tolist()``) once, cached; build
    them outside any fake mode or ledger so a fake step only copies the cached values."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torchao.optim import subclass_4bit, subclass_8bit

    with _disable_current_modes():
        for module in (subclass_8bit, subclass_4bit):
            for build in ("get_qmap_signed", "get_qmap_unsigned"):  # older torchao built them at import
                getattr(module, build, lambda: None)()


def lowbit_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """torchao's optimizer for memfit's ``name`` (a key of ``LOWBIT``) over ``params``."""
    import torchao.optim

    _warm_tables()
    cls, block_size = LOWBIT[name]
    base = getattr(torchao.optim, cls)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls, (_FakeStep, base), {"__module__": __name__})
    return _CLASSES[cls](params, lr=lr, block_size=block_size)
