"""The ledger: every tensor storage a training step allocates and frees, in order.

A ``TorchDispatchMode`` sees every aten op, real or fake. Each output whose schema says it is
fresh memory (no alias annotation) and whose storage the ledger has not seen is an allocation of
``storage.nbytes()`` bytes; a ``weakref.finalize`` on the storage records its free. This is what
the CPU allocator sees too, so on fake tensors the same sequence is reproduced without memory.

Why not ``torch.distributed._tools.MemTracker``: it snapshots live memory per module but keeps no
ordered allocate/free log, and the depth fast path, the timeline and (later) the allocator
simulation all need that log. Module attribution is written here too: ``torch.utils.module_tracker``
hooks every module output with a multi-grad hook whose closures keep tensors alive until the
garbage collector runs; with activation checkpointing that held 40% more memory than the plain
run. Here forward attribution is a stack kept by global module hooks, and backward attribution
reads the module that the running autograd node's forward was called in (stored in the node's
``metadata``), which references no tensor.

What a dispatch-level trace cannot see is scratch that a kernel allocates inside itself (oneDNN
convolution and RNN kernels, bf16 matmul reorders, mixed-dtype casts). Ops of those families are
recorded as *probe sites*; ``scratch.py`` measures their scratch with the allocator itself.

This module holds the ledger's storage log and its dispatch; three parts of it live beside it: the probe sites
(``probes.py``), the tensor subclasses whose handlers run below the mode (``subclasses.py``) and what CUDA
semantics add, workspaces and streams (``cuda_semantics.py``). The log's vocabulary is ``events.py``'s.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from memfit.accounting._modules import OUTSIDE, ModuleStack, tensors as _tensors
from memfit.accounting.cuda_semantics import CudaSemantics
from memfit.accounting.events import (ALLOC, FREE, KEPT, MANAGED, MARK, RENAME, SPIKE, Record, Site, managed_peak,
                                      plain, scaled_bytes, storage_events)
from memfit.accounting.ops import is_view, op_tensors
from memfit.accounting.probes import ProbeSites, probe_worthy
from memfit.accounting.subclasses import SubclassDispatch, dtensor_handler, local as _local, wrapper_handler
from memfit.categories import PRIORITY, Category
from memfit.scoped import patched, rng_hop_rules

# the log's vocabulary lives in events.py; re-exported here, where its users have always found it
__all__ = ["Ledger", "Record", "Site", "plain", "ALLOC", "FREE", "SPIKE", "MARK", "RENAME", "KEPT", "MANAGED", "OUTSIDE",
           "storage_events", "managed_peak"]

_BORN = {torch.ops.aten.lift_fresh.default}
_DEVICE = torch.ops.prim.device.default
_DETACH = torch.ops.aten.detach.default
_META = ("meta", torch.device("meta"))
# (backward node, op) -> the in-place op a plain run uses there. Autograd formulas take an
# out-of-place path when any input is "subclass-like", which a fake tensor, or any tensor under a
# Python dispatch mode, is (``areAnyTensorSubclassLike`` in FunctionsManual.cpp); a plain run
# scatters into its fresh zeros in place. Replaying the out-of-place op held a second copy of the
# gathered-from tensor (Inkling's relative-position bias: +11% at the peak).
# An index's backward (``index_backward``) likewise puts the gradient into its zeros in place in a plain run (a
# mixture of experts' token gather: with expert parallel's worst routing, +2 % at the backward peak).
_IN_PLACE_IN_BACKWARD = {
    ("GatherBackward0", torch.ops.aten.scatter_add.default): torch.ops.aten.scatter_add_.default,
    ("IndexBackward0", torch.ops.aten.index_put.default): torch.ops.aten.index_put_.default}
_IN_PLACE_OPS = {op for _, op in _IN_PLACE_IN_BACKWARD}
_SOFTMAX = {torch.ops.aten._softmax, torch.ops.aten._safe_softmax, torch.ops.aten.softmax}


class Ledger(CudaSemantics, ProbeSites, SubclassDispatch, TorchDispatchMode):
    """Records allocations, frees and probe sites while a step runs under it.

    Use as a context manager around the step; call :meth:`close` when done so late frees
    (garbage collection after the step) are not recorded.
    """

    def __init__(self, *, device: torch.device, model: torch.nn.Module | None = None,
                 cublas_workspace: int | None = None):
        """``cublas_workspace``: trace with CUDA semantics (``memfit.cuda``): no CPU scratch sites
        and no CPU RNG state; a workspace of this many bytes at the first matmul of forward and
        of backward (two threads, two cuBLAS handles), kept for the rest of the run."""
        super().__init__()
        self.device = device
        self.model = model
        self.cublas_workspace = cublas_workspace
        self._workspaces: set[tuple] = set()
        # the CUDA libraries the step loads ("cublas" at its first matmul): what the process then holds
        # outside the allocator (hardware/outside.py)
        self.libraries: set[str] = set()
        self.records: list[Record] = []
        self.events: list[tuple[int, int]] = []
        self.sites: list[Site] = []
        self.marks: list[tuple[str, int]] = []
        self.phase, self.step = "setup", -1
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._finalizers: list[weakref.finalize] = []
        self._modules = ModuleStack(model)
        self._open = True
        self._handlers = 0  # DTensor handlers running under this mode (``_handled``)
        # The mode directly below while this one is pushed, if it says ``inline_under_ledger`` (the estimator's
        # ``ScalarReads``): taken off the stack, its ``__torch_dispatch__`` called inside this mode's, each op passes
        # one Python mode fewer (~7 % of a fake trace); put back on exit
        self._inline = None
        self.attention_matrices: dict[str, int] = {}  # module -> bytes of its largest S x S softmax
        self.offloaded_bytes = 0  # saved activations moved off the device (activation offload)
        self.offloaded_scaled = 0  # with ``prime``: the part of it that scales with the batch
        self.prime: int | None = None  # the batch has this prime number of rows (the planner)
        self.counter = None  # an ``ops.OpCounter`` while one is attached (the planner)
        self.on_phase = None  # called with no arguments as each phase begins (a progress bar)
        # Names of more aten ops whose kernel scratch is replayed (``scratch.py``) beside ``probes.probe_worthy``'s:
        # a generation's ``_scaled_dot_product_flash_attention_for_cpu`` (per-thread buffers of the prefill).
        self.probe_ops: frozenset[str] = frozenset()
        # Several devices (``device_map``): ``placer.place(ledger, args, kwargs, made, many)`` gives each
        # new storage its device, ``placer.own(ledger)`` the model's own tensors theirs by owner.
        self.placer = None
        self.stream = 0  # the stream new storages are allocated on (``on_stream``)
        # ``UntypedStorage.resize_`` frees and re-allocates a storage that lives on (FSDP2's unsharded
        # parameters: ``free_storage`` / ``alloc_storage``): each allocation is a record of its own.
        # ``_current``: the record a storage's first record stands for now (None: resized to nothing).
        self._current: dict[int, int | None] = {}
        self._first: dict[int, int] = {}
        self._chain: dict[int, list[int]] = {}  # first record -> every record of its storage

    # -- the step runner tells the ledger where it is --------------------------------------
    def begin(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step
        if phase == "forward":
            self._attribute_parameters()
        self.marks.append((phase, step))
        self.events.append((MARK, len(self.marks) - 1))
        if self.on_phase is not None:
            self.on_phase()

    def register(self, tensor: torch.Tensor, category: Category) -> None:
        """Account a storage that exists before the step (parameters, buffers, the batch)."""
        owner = self._modules.owner_of(tensor)
        for local in plain(tensor):
            index = self._track(local.untyped_storage(), category)
            if index is not None:
                self.records[index].owner = owner
                if self.prime:
                    self.records[index].scaled = scaled_bytes(local, self.prime)
                self.mark(local, category)

    def settle(self) -> None:
        """What ran so far built the model (FSDP2 sharding it): the step starts from what is live now.

        The events so far are replaced by one allocation of each storage still live, so the peak,
        the phases and the timeline are of the step, not of the construction. Called by a technique
        whose ``apply`` rebuilds the parameters (``techniques/parallel.py``)."""
        live: dict[int, None] = {}
        for kind, index in self.events:
            if kind == ALLOC:
                live[index] = None
            elif kind == FREE:
                live.pop(index, None)
        for index in live:
            self.records[index].phase, self.records[index].step = "setup", -1
        self.events = [(ALLOC, index) for index in live]
        self.marks, self.sites = [], []

    @property
    def blocks(self) -> list[str]:
        """Module names of the containers of repeated blocks (``Model.model.layers``)."""
        return self._modules.blocks()

    def _attribute_parameters(self) -> None:
        """Give an owner to tensors of the model that the set-up made (LoRA adapters added by
        ``apply`` after the parameters were registered)."""
        for tensor, name in self._modules.owned_tensors():
            record = self.record_of(tensor)  # a DTensor (FSDP2's shard): its local tensor's record
            if record is not None and record.owner is None:
                record.owner = name
        if self.placer is not None:
            self.placer.own(self)

    def note_offload(self, tensor: torch.Tensor) -> None:
        """A saved tensor left the device (activation offload): bytes over the host link."""
        self.offloaded_bytes += tensor.untyped_storage().nbytes()
        if self.prime:
            self.offloaded_scaled += scaled_bytes(tensor, self.prime)

    def mark(self, tensor: torch.Tensor, category: Category) -> None:
        """Give ``tensor``'s storage a stronger role, if it is tracked."""
        if torch.compiler.is_compiling():  # dynamo traces saved-tensor hooks: no graph break for memfit
            return
        for local in plain(tensor):
            index = self._ids.get(local.untyped_storage())
            if index is None:
                continue
            # a storage resized in place (FSDP2) is a chain of records: the role is the storage's
            for number in self._chain.get(self._first.get(index, index), (index,)):
                record = self.records[number]
                if PRIORITY[category] > PRIORITY[record.category]:
                    record.category = category

    def manage(self, tensors) -> None:
        """``tensors`` (one parameter's state buffers) live in CUDA managed memory, outside the
        caching allocator: each tracked storage is marked with their total bytes."""
        indices = [i for i in (self._ids.get(t.untyped_storage()) for t in tensors) if i is not None]
        total = sum(self.records[i].nbytes for i in indices)
        for i in indices:
            self.records[i].managed = total

    def close(self) -> None:
        self._open = False
        for fin in self._finalizers:
            fin.detach()
        self._finalizers.clear()

    # -- internals ---------------------------------------------------------------------------
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile runs under the ledger (``techniques/compile.py``): off while dynamo and
        # Inductor compile (they trace on their own fake tensors), on for the compiled code.
        return True

    def __enter__(self):
        # The global module hooks and the patched ``torch.get_rng_state`` live exactly as long as
        # the mode is pushed (``memfit.scoped``): undone on exit, and on a failed enter.
        with contextlib.ExitStack() as scope:
            scope.enter_context(self._modules)
            resize = torch.UntypedStorage.resize_

            def tracked_resize(storage, size):
                before = storage.nbytes()
                out = resize(storage, size)
                if storage.nbytes() != before:
                    self._resized(storage)
                return out

            scope.enter_context(patched(torch.UntypedStorage, "resize_", tracked_resize))
            self._rng_state = torch.get_rng_state
            if self.cublas_workspace is None:
                # by a weak reference: torch caches lists of its functions (an lru_cache of torch.overrides)
                # that, built while the patch is in, would hold the ledger, and with a profile the model
                me = weakref.ref(self)
                rng_state = self._rng_state

                def tracked_rng_state():
                    ledger = me()
                    return rng_state() if ledger is None else ledger._tracked_rng_state()

                scope.enter_context(patched(torch, "get_rng_state", tracked_rng_state))
            below = _get_current_dispatch_mode()
            if getattr(below, "inline_under_ledger", False):
                self._inline = inline = _pop_mode()
                scope.callback(_push_mode, inline)  # on exit (last first): forgotten, then back on the stack
                scope.callback(setattr, self, "_inline", None)
            out = super().__enter__()
            self._scope = scope.pop_all()
        return out

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._scope.close()

    def _tracked_rng_state(self):
        # The CPU generator's state (5,056 bytes) is allocated without passing the dispatcher;
        # activation checkpointing keeps one per checkpointed region until its backward.
        state = self._rng_state()
        if torch.compiler.is_compiling():  # traced by dynamo (a checkpoint inside a compiled step)
            return state
        self._track(state.untyped_storage(), Category.TEMPORARIES)
        return state

    def _module(self) -> str:
        return self._modules.current()

    def record_of(self, tensor: torch.Tensor) -> Record | None:
        """The record of the storage that holds ``tensor``'s memory, if tracked."""
        for local in plain(tensor):
            index = self._ids.get(local.untyped_storage())
            if index is not None:
                return self.records[index]
        return None

    @property
    def root(self) -> str:
        """The prefix of every module name in the records (the model's class name)."""
        return self._modules.root

    def _track(self, storage, category: Category) -> int | None:
        if storage in self._ids:
            return None
        nbytes = storage.nbytes()
        index = len(self.records)
        self.records.append(Record(nbytes, category, self.phase, self.step, self._module(), stream=self.stream))
        self._ids[storage] = index
        self.events.append((ALLOC, index))
        self._finalizers.append(weakref.finalize(storage, self._free, index))
        return index

    def _free(self, index: int) -> None:
        current = self._current.get(index, index)
        if self._open and current is not None:
            self.events.append((FREE, current))
            self.records[current].freed_in = self._module()

    def _resized(self, storage) -> None:
        """``storage`` was resized in place: its old bytes are freed, its new bytes (if any) allocated."""
        if not self._open or torch.compiler.is_compiling():
            return
        index = self._ids.get(storage)
        if index is None:
            if storage.nbytes():
                self._track(storage, Category.TEMPORARIES)
            return
        first = self._first.get(index, index)
        category = self.records[index].category
        if self._current.get(first, first) is not None:
            self._free(first)
        if not storage.nbytes():
            self._current[first] = None
            return
        new = len(self.records)
        self.records.append(Record(storage.nbytes(), category, self.phase, self.step, self._module(),
                                   stream=self.stream))
        self.events.append((ALLOC, new))
        self._ids[storage] = new
        self._current[first], self._first[new] = new, first
        self._chain.setdefault(first, [first]).append(new)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # most of a step's dispatches (autograd asks each output's device): nothing to record
            tensor = args[0] if len(args) == 1 else None
            if type(tensor) is FakeTensor:  # FakeTensor's own answer, without passing every mode below (~10 % of a trace)
                return torch.device("meta") if tensor.fake_mode.in_kernel_invocation else tensor.fake_device
            return func(*args, **(kwargs or {}))
        if func is _DETACH and len(args) == 1 and type(args[0]) is FakeTensor and not kwargs:
            # autograd detaches each tensor it saves for backward (~19 % of a trace's ops): a view, only tagged
            out = func(*args)
            self._modules.tag(out)
            return out
        kwargs = kwargs or {}
        if kwargs.get("device") in _META:  # made on the meta device: no memory (DeepSpeed's shape records)
            return func(*args, **kwargs)
        if func in _IN_PLACE_OPS:
            node = torch._C._current_autograd_node()
            func = _IN_PLACE_IN_BACKWARD.get((node.name() if node is not None else "", func), func)
        if self.cublas_workspace is not None:
            self._workspace(func, args, kwargs)
        handler = dtensor_handler(func, args, kwargs) or wrapper_handler(types)
        if handler is None:
            out = (func(*args, **kwargs) if self._inline is None
                   else self._inline.__torch_dispatch__(func, types, args, kwargs))
        else:  # its own ops seen here, as the allocator sees theirs (loss_parallel's cross-entropy)
            out = self._handled(handler, func, args, kwargs)
        if self.counter is not None:
            self.counter.record(func, args, kwargs, out)
        returns = func._schema.returns
        flat_out = out if isinstance(out, (tuple, list)) else (out,)
        if func.namespace != "prim":  # autograd asks prim.device of an output before it sets grad_fn
            self._modules.tag(out)
        out_records, out_metas, made = [], [], []
        born = func in _BORN  # torch.tensor(data) enters through lift_fresh, annotated as an alias
        for position, value in enumerate(flat_out):
            fresh = born or position >= len(returns) or returns[position].alias_info is None
            for tensor in (local for t in _tensors(value) for local in plain(t)):
                storage = tensor.untyped_storage()
                if fresh:
                    index = self._track(storage, Category.TEMPORARIES)
                    if index is not None:
                        made.append((position, index))
                    if index is not None and self.prime:
                        self.records[index].scaled = scaled_bytes(tensor, self.prime)
                out_records.append(self._ids.get(storage) if fresh else None)
                out_metas.append((tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype))
        if made and self.records[made[0][1]].module == OUTSIDE:
            self._derive_owners(args, kwargs, made, isinstance(out, (tuple, list)))
        if made and self.placer is not None:
            self.placer.place(self, args, kwargs, made, isinstance(out, (tuple, list)))
        if func.overloadpacket in _SOFTMAX and self.phase == "forward" and isinstance(out, torch.Tensor):
            self._note_attention(out)
        donor = self._accumulation_donor(func, args, kwargs)
        if donor is not None and out_records and out_records[0] is not None:
            self.records[out_records[0]].donor = donor
            self.records[donor].donated = True
        if self.cublas_workspace is not None:
            self._conv_workspaces(func, args, out)
        if self.device.type == "cpu" and self.cublas_workspace is None and not is_view(func):
            # a DTensor's op runs its kernel on the local shards below this mode: the scratch is theirs
            # (tensor parallelism: a bf16 matmul probed at the whole weight's shape was 2x too much scratch)
            # (the arguments are rebuilt with their shards only for a site: most ops are not probed)
            tensors = [_local(t) for t in op_tensors(args, kwargs)]
            if tensors and (probe_worthy(func, tensors) or func.__name__.split(".")[0] in self.probe_ops):
                args, kwargs = tree_map(_local, (args, kwargs))
                self._add_site(func, args, kwargs, out_records, out_metas)
        return out

    def _note_attention(self, out: torch.Tensor) -> None:
        """A softmax over a square last pair of dims of a 4-D tensor is an attention matrix."""
        if out.dim() == 4 and out.shape[-1] == out.shape[-2] >= 64:
            module = self._module()
            nbytes = out.untyped_storage().nbytes()
            self.attention_matrices[module] = max(nbytes, self.attention_matrices.get(module, 0))

    def _path(self, tensor) -> str | None:
        """The module a tracked tensor belongs to: where it was made, else its owner."""
        record = self.record_of(tensor)
        if record is None:
            return None
        return record.module if record.module != OUTSIDE else record.owner

    def _derive_owners(self, args, kwargs, made, many: bool) -> None:
        """Outputs made outside any module belong where their input does: the i-th output of a
        foreach op to the i-th entry of its first list argument that has one, any other output
        to its first tensor argument that has one (``zeros_like(param)``, ``grad + grad``)."""
        lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a
                 and all(isinstance(t, torch.Tensor) for t in a)]
        flat = op_tensors(args, kwargs)
        fallback = next((p for p in map(self._path, flat) if p is not None), None)
        for position, index in made:
            owner = None
            if many:
                owner = next((p for p in (self._path(entries[position]) for entries in lists
                                          if position < len(entries)) if p is not None), None)
            self.records[index].owner = owner or fallback

    def _accumulation_donor(self, func, args, kwargs) -> int | None:
        """The gradient buffer a plain run would have added into in place, if this is that add.

        Autograd sums two gradients for one input (``InputBuffer``) or into an existing
        ``.grad`` (``AccumulateGrad``) in place when the buffer is a plain tensor nobody else
        holds; with any Python dispatch mode active (this ledger, fake tensors) it always adds
        out of place, which would put a third buffer at the very moment backward peaks. So an
        ``add`` of two same-layout gradient temporaries made in this backward counts as in place.
        """
        if func is not torch.ops.aten.add.Tensor or self.phase != "backward" or kwargs or len(args) != 2:
            return None
        if self._handlers:
            return None  # a DTensor handler's own add (loss_parallel's backward), out of place in a real run too
        if torch.is_grad_enabled() or self._modules.stack:
            return None  # a checkpoint recomputing a forward (a residual add), not the engine
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        if a.shape != b.shape or a.dtype != b.dtype or a._base is not None or not a.is_contiguous():
            return None
        index = self._ids.get(a.untyped_storage())
        if index is None:
            return None
        record = self.records[index]
        fresh = record.phase == "backward" and record.step == self.step and not record.donated
        return index if fresh and record.category is Category.TEMPORARIES else None


rng_hop_rules(Ledger)  # a compiled step's RNG operators run under it (``memfit.scoped``)
