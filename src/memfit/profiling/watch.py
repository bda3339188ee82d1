"""The profiler's watch: a ledger that finds the phases, steps and roles of a loop nobody annotated, and where
each allocation came from in the user's own code.

``memfit.profile()`` (``profile.py``) drives it from torch's hooks; ``memfit.estimate_script`` runs the same watch on
fake tensors. Where: every allocation keeps torch's captured traceback (a few microseconds), read into frames
only for the storages a report names; a frame is the user's when its file is not torch's, memfit's, the
standard library's or an installed package's (``library_roots``).
"""

from __future__ import annotations

import os
import weakref

import torch
from torch.utils._traceback import CapturedTraceback

from memfit.accounting.ledger import Ledger
from memfit.categories import Category
from memfit.errors import library_roots
from memfit.profiling.sites import FRAMES

__all__ = ["Watch", "library_roots"]


class Watch(Ledger):
    """A ledger that finds the phases, steps and roles of a loop nobody annotated. ``owner``: the ``Profile`` it
    serves (its ``fake``, whether a step is running, and the start of each backward)."""

    def __init__(self, *, device: torch.device, owner):
        super().__init__(device=device, model=None)
        self._kinds = (device.type, "meta") if owner.fake else (device.type,)
        # weakly: a profile holds its watch, and a cycle between the two (and the model, tensors and frames they
        # hold) would outlive the run until a full collection, where the next profile would count it as resident
        # (a reference, not a proxy: ``isinstance`` on a dead proxy raises, and profiles scan every live object)
        self._owner = weakref.ref(owner)
        self.captured: list = []  # per record: torch's CapturedTraceback of its allocation (None: before the profile)
        self._frames: dict[int, tuple] = {}
        self._own = os.path.dirname(os.path.dirname(__file__)) + os.sep  # memfit's frames are left out
        self.phase, self.step = "forward", 0
        self.begin("forward", 0)
        self._library = library_roots()
        self._user_cache: dict[str, bool] = {}
        self.sampler = None  # on MPS: sampled after every op (``mps_memory.MpsSampler``)

    @property
    def owner(self):
        """The ``Profile`` this watch serves (None once it is gone)."""
        return self._owner()

    # -- where an allocation comes from ------------------------------------------------------
    def _is_user(self, filename: str) -> bool:
        known = self._user_cache.get(filename)
        if known is None:
            path = os.path.realpath(filename)
            known = not (filename.startswith("<") or path.startswith(self._library))
            self._user_cache[filename] = known
        return known

    def _stack(self) -> tuple[tuple, int]:
        """((file, line, function), ...) innermost first, and the index of the innermost frame of the
        user's code (-1: none), of where the caller is now."""
        return self.frames_of(CapturedTraceback.extract(cpp=False))

    def frames_of(self, captured) -> tuple[tuple, int]:
        if captured is None:
            return (), -1
        frames = tuple((f.filename, f.lineno, f.name) for f in reversed(captured.summary())
                       if not f.filename.startswith(self._own))
        site = next((i for i, f in enumerate(frames) if self._is_user(f[0])), -1)
        if site < 0:
            return frames[:FRAMES], -1
        return frames[site:site + FRAMES], 0  # from the user's innermost frame outwards

    def _track(self, storage, category: Category) -> int | None:
        if storage.device.type not in self._kinds:  # a CUDA profile does not count host tensors, and back
            return None
        index = super()._track(storage, category)
        if index is not None:
            # torch's own captured traceback (what the CUDA memory snapshot records): a few microseconds;
            # read into frames only for the storages a report names (``stack``)
            self.captured.extend([None] * (index - len(self.captured)))
            self.captured.append(CapturedTraceback.extract(cpp=False))
        return index

    def stack(self, index: int) -> tuple[tuple, int]:
        """The frames of record ``index``'s allocation and its user site (see ``_stack``), cached."""
        found = self._frames.get(index)
        if found is None:
            found = self._frames[index] = self.frames_of(self.captured[index] if index < len(self.captured) else None)
        return found

    # -- which phase the loop is in -----------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        owner = self._owner()
        if self.phase != "backward" and owner._in_step == 0 and torch._C._current_autograd_node() is not None:
            owner._backward_began()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.sampler is not None:
            self.sampler.sample()
        return out
