"""``estimate``: the memory of training steps, computed on fake tensors.

The user's step runs unchanged under ``FakeTensorMode``: every op computes shapes and dtypes
only, so a 70B model costs no memory and no GPU. Measured on CPU, the result matches the
allocator to the byte where nothing is hidden inside kernels; kernel scratch is replayed per op
(``accounting/scratch.py``). For deep Hugging Face models a fast path traces two shallow copies
and scales by depth (``depth.py``).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)

from memfit.errors import MemfitError
from memfit.fake import ScalarReads, build_fake, fake_batch, fake_copy
from memfit.models.source import Source, resolve
from memfit.precision import check_precision, weight_dtype
from memfit.recipe import Recipe, recipe_from
from memfit.report import Report
from memfit.trace import phases, trace

__all__ = ["estimate"]

# Below this depth a full trace is cheap enough that the fast path buys nothing.
FAST_MIN_DEPTH = 8


def estimate(model, batch=None, *, loss_fn=None, optimizer="adamw", precision: str = "fp32",
             steps: int = 2, batch_size: int = 1, seq_len: int | None = None,
             device: str = "cpu", gpu=None, fast: bool | None = None, recipe: Recipe | None = None,
             progress=None) -> Report:
    """Estimate the memory of ``steps`` training steps without allocating it.

    model      an ``nn.Module``; a zero-argument callable building one (built on the meta device,
               then made fake); a catalog name (``"llama-3.1-8b"``); a path to a Hugging Face
               ``config.json``; or ``"package.module:function"``.
    batch      a tensor, tuple or dict of tensors (converted to fake), or a zero-argument
               callable returning one. ``None`` for catalog / config models: a batch of
               ``batch_size`` x ``seq_len`` tokens (or images) is made.
    loss_fn    ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss``.
    optimizer  ``adamw``, ``adam``, ``sgd``, ``adafactor`` or a callable ``params -> Optimizer``.
    precision  ``fp32``, ``bf16-mixed``, ``fp16-mixed`` or ``bf16``.
    device     whose semantics to follow: ``cpu`` (byte-exact against the CPU allocator) or
               ``cuda`` (``memfit.cuda``: CUDA autocast lists, fused attention, foreach
               optimizers, cuBLAS workspaces, and the caching allocator's rounding and segments;
               the report adds ``reserved_bytes``, ``context_bytes`` and ``device_bytes``).
    gpu        a GPU of the catalog (``"rtx-4090"``, ``memfit.gpus.gpu(...)``) for CUDA semantics:
               its workspace size and context; implies ``device="cuda"`` (default ``h100-sxm``).
    fast       trace two shallow copies and scale by depth (default: for configs with
               >= 8 blocks and no explicit batch); ``False`` forces the full trace.
    recipe     a :class:`memfit.Recipe` of memory techniques; ``precision`` and ``optimizer`` are
               shorthands for two of its fields. With accumulation, ``batch`` is what one
               optimizer step consumes; a made batch has micro_batch_size x grad_accum_steps rows.
    progress   ``progress(done, total)``, called as each phase of each trace (forward, backward,
               optimizer of every step, then the replay) begins.
    """
    check_args(precision, steps, batch_size, seq_len)
    recipe, factory = recipe_from(recipe, precision, optimizer)
    target = _target(device, gpu)
    if recipe.micro_batch_size:
        batch_size = recipe.micro_batch_size * recipe.grad_accum_steps
    source = resolve(model)
    if fast is None:
        fast = source.config is not None and batch is None and (source.depth or 0) >= FAST_MIN_DEPTH
    tick = _ticker(progress, (2 if fast else 1) * phases(recipe, steps))
    if fast:
        from memfit.depth import estimate_by_depth

        return estimate_by_depth(source, recipe=recipe, loss_fn=loss_fn, optimizer=factory,
                                 steps=steps, batch_size=batch_size, seq_len=seq_len, gpu=target, tick=tick)
    report, _ = fake_trace(source, batch, recipe=recipe, loss_fn=loss_fn, optimizer=factory,
                           steps=steps, batch_size=batch_size, seq_len=seq_len, gpu=target, tick=tick)
    return report


def _ticker(progress, total: int):
    """A ``tick()`` that reports ``progress(done, total)``; None without a progress callable."""
    if progress is None:
        return None
    done = 0
    progress(done, total)

    def tick():
        nonlocal done
        done = min(done + 1, total)
        progress(done, total)

    return tick


DEFAULT_GPU = "h100-sxm"


def _target(device, gpu):
    """None for CPU semantics, else the catalog GPU whose CUDA semantics to follow."""
    from memfit.gpus import GPU, gpu as lookup

    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise MemfitError(f"device {device!r} is not modelled: use device='cpu' or device='cuda'")
    if gpu is None:
        return lookup(DEFAULT_GPU) if kind == "cuda" else None
    return gpu if isinstance(gpu, GPU) else lookup(gpu)


def check_args(precision: str, steps: int, batch_size: int, seq_len: int | None) -> None:
    check_precision(precision)
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise MemfitError(f"{name} must be a positive integer, got {value!r}")


def fake_trace(source: Source, batch, *, recipe, loss_fn, optimizer, steps, batch_size, seq_len, gpu=None,
               detail: bool = False, prime: int | None = None, tick=None):
    """One full trace of ``source`` on fake tensors: (Report, replay); ``detail`` as for ``trace``."""
    if recipe.optimizer == "adamw4bit":
        raise MemfitError("optimizer=adamw4bit cannot be estimated on fake tensors (torchao compiles its step): "
                          "use memfit.measure, or adamw8bit")
    device = torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    dtype = weight_dtype(recipe.precision)
    if source.module is not None:
        module = fake_copy(source.module, mode, dtype)
    else:
        module = build_fake(source.build, mode, device, dtype)
    if batch is None:
        with mode:
            batch = source.make_batch(batch_size, seq_len)
    else:
        batch = fake_batch(batch, mode)
    reads = ScalarReads()
    with mode, reads:
        try:
            report, result = trace(module, batch, recipe=recipe, loss_fn=loss_fn, optimizer=optimizer,
                                   steps=steps, method="fake", gpu=gpu, detail=detail, prime=prime, tick=tick)
        except MemfitError:
            raise
        except (UnsupportedOperatorException, DataDependentOutputException,
                DynamicOutputShapeException, UnsupportedFakeTensorException) as err:
            op = getattr(err, "func", None) or str(err).splitlines()[0]
            raise MemfitError(f"operation {op} cannot run on fake tensors: run the step for real with "
                              "memfit.measure(...) instead") from None
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as err:
            raise MemfitError(f"the model rejected the batch: {_first_line(err)}") from None
    if reads.reads:
        report.notes.append(f"{reads.reads} scalar read(s) of fake tensors (.item()) were answered with 0")
    return report, result


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
