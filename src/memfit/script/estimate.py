"""``memfit.estimate_script``: a user's own, unchanged training script, run on fake tensors for a card.

The script runs as ``python SCRIPT.py args`` would (``runner.py``), inside ``memfit.profile()``'s watch
(its steps from the optimizer's step hooks, phases from module and autograd hooks, roles from the model,
optimizer and saved tensors, the user's file:line of every allocation) on fake tensors
(``FakeTensorMode``: no memory, no GPU), with ``'cuda'`` answered as the card (``device.py``) and files
kept off disk (``files.py``). After ``steps`` optimizer steps the script is stopped. The card's storages
are replayed through memfit's caching allocator under the card's memory (``estimator/verdict.py``): the
usual Report and verdict, plus where the peak happens in the script and, on an out-of-memory verdict, the
line whose allocation would fail.

Why it stands beside ``memfit.profile`` and not below it: the watch that finds a loop's steps, phases and
roles without annotations is the profiler's; a script estimate is that watch on fake tensors.

With ``device="cpu"`` the script runs under CPU semantics (its ``cuda`` is not faked: a script that asks
for ``cuda`` falls back as it would on a CPU-only machine) and the figures are the CPU allocator's bytes,
kernel scratch replayed (the byte-exact mode, checked against a real run's allocator events).

Left out: the script's host memory beyond tensors (Python objects, numpy arrays, DataLoader workers: run
them in-process, ``num_workers=0``, or their memory is theirs); ``torch.compile`` of the script's own code
is run as eager (its savings are not estimated for scripts yet: a note says so); several ranks
(``gpus>1``) run as rank 0 only.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys

from memfit.errors import MemfitError
from memfit.script.runner import Target, run, target as make_target

__all__ = ["estimate_script", "ScriptFailed", "DEFAULT_STEPS"]

DEFAULT_STEPS = 2  # the second step holds the optimizer state the first one made


class ScriptFailed(MemfitError):
    """The script raised (``error`` its exception, shown as Python shows it) or could not run on fake
    tensors (``error`` None: the message names the script's line and the operation)."""

    def __init__(self, message: str, error: BaseException | None = None, report=None):
        super().__init__(message)
        self.error = error
        self.report = report


def estimate_script(path, argv=(), *, module: bool = False, gpu=None, device=None, gpus: int = 1, nodes: int = 1,
                    rank: int = 0, steps: int = DEFAULT_STEPS, budget=None):
    """The memory of ``path`` (a script; with ``module=True`` a module's name) run with ``argv``, for a card.

    gpu      a catalog card (name or ``GPU``) whose CUDA semantics and memory the script's ``cuda`` gets;
             default as ``memfit.estimate``'s: the GPU torch sees, else the default card.
    device   "cpu": CPU semantics instead (the byte-exact mode); "cuda" (default) the card's.
    gpus     GPUs per node: what ``torch.cuda.device_count()`` answers; with more than one (or ``nodes``), the
             script runs as rank ``rank`` of a torchrun launch (``ranks.py``: its ``init_process_group`` on
             PyTorch's fake process group, DDP and FSDP2 in its own code).
    steps    optimizer steps to run before the script is stopped (0: to its end).
    budget   bytes (or "20GiB") the process may use on the card, as for ``memfit.estimate``.

    Returns the Report (``settings["script"]``: argv, steps run, exit status, the peak's site and line, the
    out-of-memory site, files not written). Raises ``ScriptFailed`` when the script raised or an operation
    cannot run on fake tensors, ``MemfitError`` on bad input."""
    from memfit.hardware.gpus import target as card_target
    from memfit.units import parse_size

    what = make_target(path, argv, module=module)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise MemfitError(f"steps must be 0 (run to the end) or more, got {steps!r}")
    for name, value in (("gpus", gpus), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemfitError(f"{name} must be 1 or more, got {value!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < gpus * nodes:
        raise MemfitError(f"rank must be one of the {gpus * nodes} ranks (0 to {gpus * nodes - 1}), got {rank!r}")
    budget = None if budget is None else parse_size(budget)
    card = card_target(device, gpu).gpu
    if card is not None and card.vendor == "apple":
        raise MemfitError(f"a script's estimate runs it as a CUDA program; on a Mac ({card.name}) it would run on "
                          "torch's mps device, which the script runner does not fake yet: estimate the model by name "
                          f"with --gpu {card.name}, or the script with --gpu for a CUDA or ROCm card")
    preload(what)
    return _Run(what, card, gpus=gpus, nodes=nodes, rank=rank, steps=steps, budget=budget).go()


class _Run:
    def __init__(self, what: Target, card, *, gpus: int, nodes: int, rank: int, steps: int, budget: int | None):
        self.what, self.card, self.steps, self.budget = what, card, steps, budget
        self.gpus, self.nodes, self.rank = gpus, nodes, rank

    def go(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from memfit.estimator.fake import ScalarReads, quiet_fake_log
        from memfit.hardware.cuda import card_semantics
        from memfit.profiling.profile import Enough, Profile
        from memfit.script.device import FakeCuda, cuda_hidden, forget_devices, swap_or_set
        from memfit.script.compiling import Compiling
        from memfit.script.files import Files
        from memfit.script.shapes import UpperBounds
        from memfit.script.values import Values

        card = self.card
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        reads = ScalarReads()
        bounds = UpperBounds()
        values = Values()
        shim = FakeCuda(card, gpus=self.gpus) if card is not None else None
        files = Files(mode)
        prof = Profile(device="cpu", max_steps=self.steps or None, record_history=False, fake=True)
        status, failed = 0, None
        with contextlib.ExitStack() as scope:
            scope.enter_context(quiet_fake_log())
            scope.enter_context(swap_or_set())
            forget_devices()
            scope.callback(forget_devices)
            groups = None
            if self.gpus * self.nodes > 1:
                from memfit.script.ranks import as_rank

                groups = scope.enter_context(as_rank(self.gpus, self.nodes, self.rank, watch=lambda: prof.watch))
            scope.enter_context(cuda_hidden() if card is None else shim)
            scope.enter_context(files)
            compiling = scope.enter_context(Compiling(shim))
            if shim is not None:
                from memfit.script.device import counted_dispatch

                scope.enter_context(counted_dispatch(mode, shim))
            scope.enter_context(mode)
            scope.enter_context(bounds)
            scope.enter_context(reads)
            scope.enter_context(values)
            if card is not None:
                scope.enter_context(card_semantics(card))
            try:
                with prof:
                    watch = prof.watch
                    values.ledger = watch
                    if shim is not None:
                        values.host = "cpu"
                        shim.attach(watch)
                    status = run(self.what)
            except Enough:  # pragma: no cover (the block swallows it)
                pass
            except KeyboardInterrupt:
                raise
            except BaseException as err:  # the script's own, or an op fake tensors cannot run
                failed = err
        if isinstance(failed, MemfitError):  # memfit refused something the script did: where, in one line
            where = _user_frame(failed, self.what)
            raise MemfitError((f"{_short(where[0])}:{where[1]}: " if where else "") + str(failed)) from None
        if failed is not None and _fake_failure(failed):
            raise ScriptFailed(_unfakeable(failed, prof, self.what)) from None
        if failed is not None and prof.steps == 0:
            raise ScriptFailed(f"{self.what.name} raised {type(failed).__name__}: {_first_line(failed)}",
                               failed) from None
        if failed is not None:
            raise ScriptFailed(f"{self.what.name} raised {type(failed).__name__} after {prof.steps} step(s): "
                               f"{_first_line(failed)}", failed) from None
        if prof.steps == 0:
            raise MemfitError(f"{self.what.name} ran no optimizer step (exit status {status}): memfit counts "
                              "torch.optim optimizers' steps (HF Trainer, accelerate and Lightning use them); "
                              "does the script train, and with these arguments?")
        from memfit.script.answer import report

        return report(prof, card, budget=self.budget, what=self.what, status=status, files=files,
                      reads=reads.reads + values.reads, steps_asked=self.steps,
                      fraction=shim.api.fraction if shim is not None else None, groups=groups, rank=self.rank,
                      compiled=compiling, bounds=bounds.taken)


# libraries a script may import that read the CUDA runtime when imported (bitsandbytes binds CUDA functions
# when torch says CUDA is there) or cache whether it is there (transformers' and accelerate's lru_caches):
# imported before the run, as this machine is, and their caches cleared around it (``device.py``)
PRELOAD = ("torch.distributed.checkpoint", "safetensors.torch", "bitsandbytes", "transformers", "peft", "accelerate",
           "lightning", "pytorch_lightning", "datasets", "torchao")


def preload(what: Target) -> None:
    """Import the libraries of ``PRELOAD`` that the script's own source names (and that are installed)."""
    import importlib
    import importlib.util
    import re

    path = what.name
    if what.module:
        spec = importlib.util.find_spec(what.name)
        path = getattr(spec, "origin", None) or ""
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            text = source.read()
    except OSError:
        return
    for name in PRELOAD:
        top = name.split(".")[0]
        if name in sys.modules or not re.search(rf"\b(import|from)\s+{top}\b", text):
            if name.startswith(("torch.", "safetensors")):
                with contextlib.suppress(Exception):
                    importlib.import_module(name)
            continue
        if importlib.util.find_spec(top) is not None:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
    # ``from transformers import Trainer``: a lazy module imports its submodule on first use, which must happen
    # here too (transformers.trainer pulls in bitsandbytes-aware code)
    for package, names in re.findall(r"^\s*from\s+([\w.]+)\s+import\s+\(?([\w\s,]+)", text, re.M):
        if package.split(".")[0] not in {n.split(".")[0] for n in PRELOAD} or package.split(".")[0] not in sys.modules:
            continue
        with contextlib.suppress(Exception):
            module = importlib.import_module(package)
            for name in names.replace("\n", " ").split(","):
                name = name.strip().split(" ")[0]
                if name:
                    with contextlib.suppress(Exception):
                        getattr(module, name)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def _fake_failure(err: BaseException) -> bool:
    """An operation fake tensors cannot run (a custom kernel without a fake implementation, a
    data-dependent shape, a CUDA-only library), not the script's own error."""
    from torch._subclasses import fake_tensor

    kinds = tuple(getattr(fake_tensor, name) for name in (
        "UnsupportedOperatorException", "DynamicOutputShapeException", "DataDependentOutputException",
        "UnsupportedFakeTensorException") if hasattr(fake_tensor, name))
    if isinstance(err, kinds):
        return True
    text = str(err)
    return any(words in text for words in ("FakeTensor", "fake tensor", "Torch not compiled with CUDA",
                                           "not linked with support for cuda", "meta tensor",
                                           "Cannot access data pointer", "data-dependent",
                                           "no fake impl", "register_fake", "Triton", "triton"))


def _user_frame(err: BaseException, what: Target):
    """(file, line) of the innermost frame of the user's own code in ``err``'s traceback (the script's own as a
    fallback: a script installed as a package is in a library folder)."""
    from memfit.errors import library_roots

    library = library_roots()
    script = os.path.realpath(what.name) if not what.module else None
    best = fallback = None
    tb = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        path = os.path.realpath(name)
        if not name.startswith("<") and not path.startswith(library):
            best = (name, tb.tb_lineno)
        if script is not None and path == script:
            fallback = (name, tb.tb_lineno)
        tb = tb.tb_next
    return best or fallback


def _short(path: str) -> str:
    from memfit.profiling.sites import short

    return short(path)


def _unfakeable(err: BaseException, prof, what: Target) -> str:
    where = _user_frame(err, what)
    place = f"{_short(where[0])}:{where[1]}" if where else what.name
    code = linecache.getline(where[0], where[1]).strip() if where else ""
    op = _first_line(err)
    if len(op) > 160:
        op = op[:157] + "..."
    return (f"{place}: cannot run on fake tensors ({type(err).__name__}: {op})" + (f" in `{code}`" if code else "")
            + "; memfit estimates what torch's own ops do: a custom CUDA/Triton kernel or a value read back to "
              "drive the run needs a fake implementation (torch.library.register_fake) or a real GPU "
              "(memfit profile)")
