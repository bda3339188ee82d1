"""``memfit.profile()``: the memory of the user's own training loop, by category, step and module.

    with memfit.profile() as prof:
        for batch in loader:               # the user's loop, unchanged
            loss = model(**batch).loss
            loss.backward()
            optimizer.step(); optimizer.zero_grad()
    print(prof.report)                     # a Report, as an estimate's: compare them field by field
    prof.report.leaks                      # memory that grows step after step, by file:line

What watches: the same ``Ledger`` (``accounting/ledger.py``) that traces an estimate, on the real
tensors of the loop, so a profile and an estimate speak one vocabulary and can be compared
category by category. What memfit's own step tells the ledger (which phase, which step, which
tensor is what), the user's loop does not, so it is read from torch's own hooks:

- steps: the optimizer's ``step`` (torch's global optimizer step hooks fire for every
  ``torch.optim.Optimizer``), or ``prof.step()`` where a loop has no torch optimizer;
- phases: ``forward`` from the first module call after a step or a backward (global module
  pre-hooks), ``backward`` from the first op the autograd engine runs, ``optimizer`` inside ``step``;
- categories: the first top-level module with parameters is the model (its parameters and buffers),
  its tensor inputs are the batch, what autograd saves is activations (a ``saved_tensors_hooks``
  pair around the whole loop), ``.grad`` and ``optimizer.state`` are gradients and optimizer state
  when the optimizer steps; tensors alive before the profile began that are none of these count as
  the batch (input data); everything else is temporaries;
- where: every allocation keeps the Python stack that made it; its *site* is the innermost frame of
  the user's own code (not torch, memfit, an installed package or the standard library).

Leaks: memory that grows step after step, by allocation site (``sites.py``, where the rule is).

On CUDA the allocator's history (``torch.cuda.memory._record_memory_history``) is recorded beside
the ledger: the raw snapshot (which PyTorch's memory_viz page opens) and the reserved bytes over time
(``cuda_snapshot.py``); ``max_memory_allocated`` and ``max_memory_reserved`` are in ``settings``. On a Mac
(``device="mps"``) torch.mps's current and driver figures are sampled after every op (``mps_memory.py``): MPS
keeps no peak before torch 2.13.

Why by hand: torch.profiler's memory timeline and the CUDA snapshot record allocations with stacks,
but neither knows a parameter from an activation, a phase or an optimizer step, nor runs on CPU
tensors with categories; ``torch.distributed._tools.MemTracker`` needs the model and optimizer
handed to it and keeps no ordered log, which the timeline and the leak finder need.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections import Counter

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memfit.accounting.budget import VirtualBudget
from memfit.accounting.ledger import ALLOC, FREE, storage_events
from memfit.accounting.replay import replay
from memfit.accounting.scratch import measure_scratch
from memfit.categories import Category
from memfit.errors import MemfitError
from memfit.estimator.trace import fold_peaks, numel
from memfit.profiling.composite_steps import hooked
from memfit.profiling.sites import largest_at, leaks, short
from memfit.profiling.watch import Watch
from memfit.report.report import Report
from memfit.units import format_size
from memfit.units import parse_size

_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)

__all__ = ["profile", "Profile", "Enough"]



class Enough(BaseException):
    """Raised from the optimizer's step once ``max_steps`` steps are profiled: ends the script. A
    ``BaseException`` (as ``KeyboardInterrupt`` is), so a script's own ``except Exception`` lets it through."""


class Profile:
    """What ``memfit.profile()`` saw. ``report`` (a :class:`~memfit.Report`) once the block has ended.

    report        peak, categories at the peak, phase and step peaks, modules, the stacked timeline, the
                  largest allocations at the peak with their stacks (``top_allocations``) and ``leaks``.
    steps         optimizer steps seen (or marked with :meth:`step`).
    oom           None, or what was live when an out-of-memory error ended the block: message, phase, step,
                  live_bytes, by_category.
    forwards_without_backward  forward passes that saved activations for a backward that never came
                  (an evaluation without ``torch.no_grad()``): step, bytes, site.
    inputs        the model's tensor inputs of each step: step, shapes, tokens (elements of the largest), and
                  the first call's keyword and positional tensors (shape, dtype) to rebuild such a batch.
    snapshot      on CUDA, the allocator's raw snapshot (``torch.cuda.memory._snapshot()``).
    """

    def __init__(self, *, model=None, device=None, max_steps: int | None = None, budget=None,
                 record_history: bool | None = None, fake: bool = False):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type not in ("cpu", "cuda", "mps"):
            raise MemfitError(f"memfit profile watches cpu, cuda or mps memory, not {self.device.type!r}")
        if self.device.type == "mps" and not fake:
            from memfit.hardware.mps import require_mps

            require_mps()
        self.max_steps = max_steps
        self.budget = None if budget is None else parse_size(budget)
        if self.budget is not None and self.device.type != "cpu":
            raise MemfitError("budget= is the CPU's virtual budget; on a GPU cap the process with "
                              f"torch.{self.device.type}.set_per_process_memory_fraction")
        self.record_history = self.device.type == "cuda" if record_history is None else record_history
        self._model = model
        # the block runs on fake tensors (``memfit.estimate_script``): every storage it makes counts (a fake
        # tensor's storage is on the meta device), none made before it does, and ``report`` is left to the caller
        self.fake = fake
        self.report: Report | None = None
        self.steps = 0
        self.oom: dict | None = None
        self.forwards_without_backward: list[dict] = []
        self.inputs: list[dict] = []
        self.snapshot = None
        self.sampler = None  # on MPS: what torch.mps says, sampled after every op (``mps_memory.py``)
        self.entry_bytes = 0  # bytes of the tensors alive when the block began (in the report's figures)
        self._in_step = 0
        self._called = False  # a module ran since the last step ended
        self._seen_inputs = False  # the model's own input hook has run
        self._boundaries: list[int] = []  # event count at the end of each step
        self._forward: dict | None = None  # the forward pass being watched: step, packed bytes, used
        self._scope = None
        self.watch: Watch | None = None

    # -- the block ----------------------------------------------------------------------------
    def __enter__(self) -> "Profile":
        watch = self.watch = Watch(device=self.device, owner=self)
        with contextlib.ExitStack() as scope:
            if not self.fake:
                gc.collect()
                self._existing(watch)
            if self.budget is not None:
                resident = sum(r.nbytes for r in watch.records)
                scope.enter_context(VirtualBudget(self.budget, resident=resident))
            if self.device.type == "cuda":  # the report's peak is the allocator's own, from here on
                torch.cuda.reset_peak_memory_stats(self.device)
            if self.device.type == "mps" and not self.fake:
                from memfit.profiling.mps_memory import MpsSampler

                self.sampler = watch.sampler = MpsSampler()
                self.sampler.start()
            if self.record_history:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
                scope.callback(torch.cuda.memory._record_memory_history, enabled=None)
            handles = [register_optimizer_step_pre_hook(self._optimizer_begins),
                       register_optimizer_step_post_hook(self._optimizer_ends),
                       torch.nn.modules.module.register_module_forward_pre_hook(self._module_called),
                       torch.nn.modules.module.register_module_forward_hook(self._module_returned, with_kwargs=True)]
            scope.callback(lambda: [h.remove() for h in handles])
            scope.enter_context(hooked(self._optimizer_begins, self._optimizer_ends))  # torchao's CPU offload
            scope.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
            scope.enter_context(watch)
            self._scope = scope.pop_all()
        if self._model is not None:
            self._adopt(self._model)
        return self

    def __exit__(self, kind, error, tb):
        if self.record_history and self.device.type == "cuda":
            self.snapshot = torch.cuda.memory._snapshot()
        if isinstance(error, torch.OutOfMemoryError):
            self.oom = self._at_oom(str(error))
        self._close_forward()
        self._scope.close()
        self.watch.close()
        marks = self.watch.marks
        if self.steps and not self._called and marks and marks[-1] == ("forward", self.steps):
            marks[-1] = ("after", self.steps)  # what ran after the last step: no forward of a next one
        # a fake run's report is its caller's to make (memfit.script: the card's side, the script's lines)
        self.report = None if self.fake else self._report()
        return isinstance(error, Enough)

    def step(self) -> None:
        """Mark the end of a step by hand (a loop whose optimizer is not a ``torch.optim.Optimizer``)."""
        self._step_ends()

    # -- hooks -------------------------------------------------------------------------------
    def _existing(self, watch: Watch) -> None:
        """Tensors alive before the block: parameters as parameters, the rest as input data until a
        stronger role is seen (a module's buffer, a gradient, optimizer state)."""
        tensors, roles = [], []
        with warnings.catch_warnings():  # isinstance on lazy module attributes (torch.distributed.reduce_op) warns
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            # a weak proxy (anyone's) is skipped unread: ``isinstance`` on one whose object is gone raises
            found = [obj for obj in objects if type(obj) not in _PROXIES
                     and isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer))]
        del objects
        for obj in found:
            if isinstance(obj, torch.Tensor) and not isinstance(obj, torch._subclasses.FakeTensor):
                tensors.append(obj)
                if isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
                    roles.append((obj.grad, Category.GRADIENTS))
            elif isinstance(obj, torch.nn.Module):
                roles.extend((buf, Category.BUFFERS) for buf in obj._buffers.values() if buf is not None)
            elif isinstance(obj, torch.optim.Optimizer):
                # torchao's CPUOffloadOptimizer is an Optimizer that never ran Optimizer.__init__: no ``state`` (its
                # per-parameter optimizers, found here too, hold it)
                roles.extend((value, Category.OPTIMIZER_STATE) for state in getattr(obj, "state", {}).values()
                             for value in state.values() if isinstance(value, torch.Tensor))
        known = [(t, Category.PARAMETERS) for t in tensors if isinstance(t, torch.nn.Parameter)] + roles
        for tensor, category in known + [(t, Category.BATCH) for t in tensors]:
            try:
                if tensor.device.type == self.device.type and not tensor.is_meta:
                    watch.register(tensor, category)
            except (RuntimeError, NotImplementedError):  # sparse, nested or otherwise storage-less
                continue
        del tensors, roles, known, found
        for index, record in enumerate(watch.records):
            record.phase, record.step = "setup", -1
            watch.captured[index] = None
        self.entry_bytes = sum(r.nbytes for r in watch.records)

    def _adopt(self, module: torch.nn.Module) -> None:
        watch = self.watch
        watch.model = module
        watch._modules.model = module
        watch._modules.root = type(module).__name__
        watch._modules._owners = None
        watch._modules._name_modules()
        handle = module.register_forward_pre_hook(self._inputs, with_kwargs=True, prepend=True)
        self._scope.callback(handle.remove)
        for param in module.parameters():
            watch.mark(param, Category.PARAMETERS)
        for buf in module.buffers():
            watch.mark(buf, Category.BUFFERS)

    def _module_called(self, module, args):
        if torch.compiler.is_compiling():  # dynamo traces module hooks: the watch stays out of the graph
            return None
        if torch._C._current_autograd_node() is not None or self._in_step:
            return None  # a checkpointed region recomputing inside backward; a module inside the optimizer
        watch = self.watch
        if watch._modules.stack:
            return None
        if watch.model is None and next(module.parameters(), None) is not None:
            self._adopt(module)
        self._called = True
        if watch.phase != "forward":
            self._close_forward()
            watch.begin("forward", self.steps)
        if module is watch.model:
            self._close_forward()
            self._forward = {"step": self.steps, "bytes": 0, "used": False,
                             "site": self._site_here(), "grad": torch.is_grad_enabled()}
        return None

    def _inputs(self, module, args, kwargs):
        """The model's tensor inputs are the batch: read before its forward runs (a long batch that runs out
        in its own forward is still on record), by a hook of the model's own (global pre-hooks see no kwargs)."""
        if torch.compiler.is_compiling():  # dynamo traces module hooks: the watch stays out of the graph
            return None
        if torch._C._current_autograd_node() is not None or self._in_step:
            return None
        self._seen_inputs = True
        tensors = [t for t in torch.utils._pytree.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for tensor in tensors:
            self.watch.mark(tensor, Category.BATCH)
        if tensors and (not self.inputs or self.inputs[-1]["step"] != self.steps):
            self.inputs.append({"step": self.steps, "shapes": [list(t.shape) for t in tensors],
                                "tokens": max(t.numel() for t in tensors),
                                "kwargs": {name: {"shape": list(value.shape), "dtype": str(value.dtype)[6:]}
                                           for name, value in kwargs.items() if isinstance(value, torch.Tensor)},
                                "args": [{"shape": list(a.shape), "dtype": str(a.dtype)[6:]} if isinstance(
                                    a, torch.Tensor) else None for a in args]})
        return None

    def _module_returned(self, module, args, kwargs, output):
        """The model's first call, which ran before its own input hook existed."""
        if torch.compiler.is_compiling():  # dynamo traces module hooks: the watch stays out of the graph
            return None
        if module is self.watch.model and not self._seen_inputs:
            self._inputs(module, args, kwargs)
        return None

    def _site_here(self) -> str | None:
        stack, site = self.watch._stack()
        return None if site < 0 else f"{short(stack[0][0])}:{stack[0][1]}"

    def _backward_began(self) -> None:
        if self._forward is not None:
            self._forward["used"] = True
        self.watch.begin("backward", self.steps)

    def _pack(self, tensor):
        self.watch.mark(tensor, Category.ACTIVATIONS)
        if self._forward is not None and self.watch.phase == "forward":
            record = self.watch.record_of(tensor)
            if record is not None and record.category is Category.ACTIVATIONS and not getattr(record, "_packed", False):
                record._packed = True
                self._forward["bytes"] += record.nbytes
        # kept as itself, a saved output would hold its own grad_fn: a reference cycle (apply.py)
        return tensor.detach() if tensor.grad_fn is not None else tensor

    def _unpack(self, tensor):
        if self._forward is not None:
            self._forward["used"] = True
        return tensor

    def _close_forward(self) -> None:
        forward, self._forward = self._forward, None
        if forward and forward["grad"] and forward["bytes"] and not forward["used"]:
            self.forwards_without_backward.append(
                {"step": forward["step"], "bytes": forward["bytes"], "site": forward["site"]})

    def _roles(self, optimizer) -> None:
        watch = self.watch
        for group in optimizer.param_groups:
            for param in group["params"]:
                watch.mark(param, Category.PARAMETERS)
                if param.grad is not None:
                    watch.mark(param.grad, Category.GRADIENTS)
        for state in getattr(optimizer, "state", {}).values():  # none in torchao's CPUOffloadOptimizer
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    watch.mark(value, Category.OPTIMIZER_STATE)

    def _optimizer_begins(self, optimizer, args, kwargs):
        self._in_step += 1
        if self._in_step == 1:
            self._close_forward()
            self._roles(optimizer)
            self.watch.begin("optimizer", self.steps)

    def _optimizer_ends(self, optimizer, args, kwargs):
        self._in_step -= 1
        if self._in_step == 0:
            self._roles(optimizer)
            self._step_ends()

    def _step_ends(self) -> None:
        self._close_forward()
        self._boundaries.append(len(self.watch.events))
        self.steps += 1
        self.watch.begin("forward", self.steps)
        self._called = False
        if self.max_steps and self.steps >= self.max_steps:
            raise Enough(f"profiled {self.steps} steps")

    def _at_oom(self, message: str) -> dict:
        live = Counter()
        for kind, index in storage_events(self.watch):
            if kind in (ALLOC, FREE):
                record = self.watch.records[index]
                live[record.category.value] += record.nbytes if kind == ALLOC else -record.nbytes
        return {"message": message.strip().splitlines()[0] if message.strip() else "out of memory",
                "phase": self.watch.phase, "step": self.steps, "live_bytes": sum(live.values()),
                "by_category": {k: v for k, v in live.items() if v}}

    # -- the report ----------------------------------------------------------------------------
    def _report(self) -> Report:
        watch = self.watch
        scratch, unprobed = measure_scratch(watch) if self.device.type == "cpu" else ([0] * len(watch.sites), 0)
        result = replay(watch, scratch)
        steps = max(self.steps, 1)
        model = watch.model
        params = list(model.parameters()) if model is not None else []
        notes = [f"{self.steps} optimizer step(s) seen" if self.steps else
                 "no optimizer step seen: all of it counts as step 1 (mark steps with prof.step())"]
        if unprobed:
            notes.append(f"{unprobed} large op call(s) were not replayed for kernel scratch; their scratch is not counted")
        found = leaks(watch, self._boundaries)
        if self.steps and self.steps < 4:
            notes.append("leaks are looked for over 4 steps or more; fewer were profiled")
        extra = {}
        if self.device.type == "cuda":
            extra = _cuda_fields(self.snapshot, self.watch)
        elif self.sampler is not None:
            extra = self.sampler.fields()
        settings = {"steps": self.steps, "workload": "train" if self.steps else "forward",
                    "inputs": self.inputs, "budget": self.budget}
        settings.update(extra.pop("settings", {}))
        if self.device.type == "cuda":
            # What a user compares with: torch.cuda.max_memory_allocated(), each block rounded up by the
            # caching allocator (512 B, or the 2 MiB / 20 MiB segment rules), which the ledger's tensor
            # bytes are not. The categories, phases and steps stay the ledger's.
            settings["ledger_peak_bytes"] = result.peak_bytes
            notes.append("peak: the caching allocator's max_memory_allocated (blocks rounded up); categories, phases "
                         f"and steps are tensor bytes (their peak {format_size(result.peak_bytes)})")
        peak = settings["max_memory_allocated"] if self.device.type == "cuda" else result.peak_bytes
        if self.sampler is not None:
            settings["ledger_peak_bytes"] = result.peak_bytes
            peak, said = self.sampler.peak(result.peak_bytes)
            notes.append(said)
        return Report(
            peak_bytes=peak,
            by_category=result.by_category,
            **fold_peaks(result.phase_peaks, steps),
            modules=result.modules,
            timeline=result.timeline,
            stacked=result.stacked,
            device=self.device.type,
            method="profiled",
            modelled_bytes=result.scratch_at_peak,
            unprobed_ops=unprobed,
            parameters=sum(numel(p) for p in params),
            trainable=sum(numel(p) for p in params if p.requires_grad),
            settings=settings,
            notes=notes,
            top_allocations=largest_at(watch, result.peak_event),
            leaks=found,
            **extra,
        )

    def to_dict(self) -> dict:
        """The report's fields, and ``steps`` (one entry per optimizer step with its peak), ``leaks``,
        ``oom``, ``forwards_without_backward`` and ``inputs``: what ``memfit profile --json`` prints."""
        data = self.report.to_dict()
        data["steps"] = [{"step": k + 1, "peak_bytes": peak, "tokens": _tokens(self.inputs, k)}
                         for k, peak in enumerate(self.report.step_peaks[: max(self.steps, 0)])]
        data["leaks"] = self.report.leaks or []
        data["oom"] = self.oom
        data["forwards_without_backward"] = self.forwards_without_backward
        data["inputs"] = self.inputs
        return data


def profile(*, model=None, device=None, max_steps: int | None = None, budget=None,
            record_history: bool | None = None) -> Profile:
    """Watch the memory of the code inside ``with memfit.profile() as prof:``; ``prof.report`` after.

    model      the model, if the first top-level module with parameters that runs is not it.
    device     "cpu", "cuda" or "mps" (default: cuda when available): whose tensors are counted.
    max_steps  end the block (quietly) after this many optimizer steps: ``Enough`` is raised from the
               step, so the rest of the loop does not run.
    budget     CPU only: a virtual cap (``"300MiB"``) past which allocations raise
               ``torch.OutOfMemoryError``, as a card would (``memfit doctor`` runs scripts so).
    record_history  on CUDA (default): record the allocator's history for ``prof.snapshot``.
    """
    return Profile(model=model, device=device, max_steps=max_steps, budget=budget, record_history=record_history)


def _tokens(inputs, step):
    return max((entry["tokens"] for entry in inputs if entry["step"] == step), default=None)


def _cuda_fields(snapshot, watch) -> dict:
    from memfit.profiling.cuda_snapshot import reserved_series

    fields = {"settings": {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                           "max_memory_reserved": torch.cuda.max_memory_reserved()},
              "reserved_bytes": torch.cuda.max_memory_reserved()}
    if snapshot is not None:
        fields["reserved"] = reserved_series(snapshot)
    return fields
