"""What a trace with CUDA semantics adds to the ledger's log beside the step's own storages: the cuBLAS workspace
of each thread's handle (forward's and backward's, per device), cuDNN's workspace of each convolution call, and
the stream each storage is allocated on (``Record.stream``: the caching allocator keeps a pool per stream).

A CPU trace sees none of these; ``Ledger(cublas_workspace=...)`` turns them on. Left out: the bytes of the CUDA
context and the libraries the step loads, outside the allocator (``hardware/outside.py``; the ledger only notes
which libraries, ``Ledger.libraries``), and kernel scratch on the CPU (``probes.py``).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map

from memfit.accounting.events import ALLOC, FREE, Record, plain
from memfit.accounting.subclasses import local
from memfit.categories import Category

__all__ = ["CudaSemantics"]

# the convolution ops, whose calls each take a cuDNN workspace on CUDA
_CONV_OPS = {torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default}
# ops that take a cuBLAS handle, and with it the thread's workspace, on CUDA
_MATMUL_OPS = {getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "vdot", "addbmm", "_addmm_activation")}
# the vector products: on ROCm hipBLAS runs them (its own workspace), hipBLASLt the matrix ones (hardware/amd.py)
_VECTOR_OPS = {getattr(torch.ops.aten, name) for name in ("addmv", "mv", "dot", "vdot")}


class CudaSemantics:
    """The ledger's part that logs the CUDA libraries' workspaces and each storage's stream (``Ledger``'s
    ``records``, ``events``, ``phase``, ``step``, ``placer``, ``stream``, ``libraries`` and ``cublas_workspace``)."""

    # records of storages in host memory on a trace whose tensors all stand for the GPU's (``on_host``)
    host: frozenset = frozenset()
    pinned: frozenset = frozenset()
    # (library, bytes) of the card's BLAS workspaces (``GPU.blas_workspaces``); () = one cuBLAS one of cublas_workspace
    workspaces: tuple = ()
    convolution_workspaces = True  # cuDNN's (MIOpen's on ROCm, taken at cuDNN's rule); a Mac's are MPSGraph's own

    def follow(self, card) -> None:
        """Log the workspaces ``card`` (a catalog ``GPU``) takes: its BLAS libraries', and its convolutions' unless
        it is a Mac (MPS allocates neither from torch's heaps)."""
        self.workspaces = card.blas_workspaces
        self.convolution_workspaces = card.vendor != "apple"

    @contextlib.contextmanager
    def on_host(self, pinned: bool = False):
        """Storages allocated inside are in host memory (torchao's CPUOffloadOptimizer: its copies of each parameter
        and gradient, ``pinned``, and its optimizer's state and step on the CPU): ``host`` (and ``pinned``) hold their
        records, which the CUDA report leaves off the device (``estimator/trace.py``)."""
        start = len(self.records)
        try:
            yield
        finally:
            made = frozenset(range(start, len(self.records)))
            self.host = self.host | made
            if pinned:
                self.pinned = self.pinned | made

    def host_tensor(self, tensor: torch.Tensor, pinned: bool = False) -> None:
        """``tensor``'s storage (each record of it) is in host memory, ``pinned`` or not: for tensors found after they
        were made (DeepSpeed's offloaded partitions, by the attributes it keeps them in, and what it pins)."""
        for one in plain(tensor):
            index = self._ids.get(one.untyped_storage())
            if index is not None:
                chain = frozenset(self._chain.get(self._first.get(index, index), (index,)))
                self.host = self.host | chain
                if pinned:
                    self.pinned = self.pinned | chain

    @contextlib.contextmanager
    def on_stream(self, stream: int):
        """Storages allocated inside are on CUDA stream ``stream`` (``Record.stream``)."""
        before, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = before

    def _workspace(self, func, args, kwargs) -> None:
        if func.overloadpacket not in _MATMUL_OPS:
            return
        # autograd's engine runs a CUDA backward on its device thread, with a cuBLAS handle of its own: also a backward
        # the step phase holds (Lightning's and LBFGS's closure, run inside optimizer.step)
        backward = self.phase == "backward" or torch._C._current_autograd_node() is not None
        thread = "backward" if backward else "forward"
        kinds = self.workspaces or (("cuBLAS", self.cublas_workspace),)
        vector = len(kinds) > 1 and (func.overloadpacket in _VECTOR_OPS or any(
            isinstance(a, torch.Tensor) and a.dtype in (torch.float64, torch.complex64, torch.complex128) for a in args))
        library, nbytes = kinds[1] if vector else kinds[0]
        if not nbytes:
            return
        self.libraries.add("cublas")
        device = self.placer.device_of(self, args, kwargs) if self.placer is not None else None
        if (thread, device, library) not in self._workspaces:  # one handle per thread, device and library
            self._workspaces.add((thread, device, library))
            index = len(self.records)
            where = f", GPU {device}" if device is not None else ""
            self.records.append(Record(nbytes, Category.TEMPORARIES, self.phase, self.step,
                                       f"({library} workspace, {thread} thread{where})", device=device))
            self.events.append((ALLOC, index))

    def _conv_workspaces(self, func, args, out) -> None:
        """cuDNN's workspace of each call a convolution makes on CUDA: allocated after its outputs, freed when
        the call returns (``hardware/cuda.conv_workspaces``)."""
        if func not in _CONV_OPS or not self.convolution_workspaces:
            return
        from memfit.hardware.cuda import conv_workspaces

        args = tree_map(local, args)
        for nbytes in conv_workspaces(func, args, local(out) if isinstance(out, torch.Tensor) else None):
            index = len(self.records)
            self.records.append(Record(nbytes, Category.TEMPORARIES, self.phase, self.step, self._module(),
                                       stream=self.stream))
            self.events.append((ALLOC, index))
            self.events.append((FREE, index))

