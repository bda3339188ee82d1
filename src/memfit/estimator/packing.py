"""transformers' packed-sequence check, answered on fake tensors as the real run answers it.

transformers 5 detects packed sequences (several documents in one row, ``position_ids`` restarting
at 0 per document) in ``masking_utils.find_packed_sequence_indices`` whenever ``position_ids`` reach
``create_causal_mask`` without a padding mask or a cache — every training forward with
``use_cache=False``, which block checkpointing sets. On real tensors it returns None when no row
restarts, and the model takes SDPA's ``is_causal`` path with no mask. On a fake tensor it cannot
read the values and ``is_tracing`` says to assume packing, so a fake trace builds a
batch x 1 x seq x seq block-causal mask, an additive copy of it in every attention call (saved for
backward), and, for grouped-query attention, key/value heads repeated (``repeat_kv``: SDPA takes no
``enable_gqa`` with a mask) — where the real step has none of them.

``PackedPositions`` replaces the function while a fake step runs: it still runs the original on
the fake tensor (its small temporaries are the real run's), then answers from the real values of
the position ids when the batch gave them (``remember``; a micro-batch or an expanded view is found
through its storage), and "not packed" for position ids the model made itself (an ``arange``) or
that the batch gave without values (a batch made inside the fake mode: counted in ``unknown``).
``tests/test_packed.py`` checks both answers against the CPU allocator.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from memfit.scoped import patched

__all__ = ["PackedPositions"]


class PackedPositions:
    """Context manager: transformers' packed-sequence check answered from real position ids."""

    def __init__(self):
        self._real = WeakIdKeyDictionary()  # fake storage -> the real storage's elements, 1-D
        self._batch = WeakIdKeyDictionary()  # storages of the batch's position ids
        self.unknown = 0  # checks of batch position ids whose values were not known

    def remember(self, fake: torch.Tensor, real: torch.Tensor | None) -> None:
        """``fake`` is the batch's position ids; ``real`` the tensor it was made from (None: unknown)."""
        storage = fake.untyped_storage()
        self._batch[storage] = True
        if real is not None:
            whole = real.untyped_storage().nbytes() // real.element_size()
            self._real[storage] = real.detach().as_strided((whole,), (1,), 0)

    def _values(self, fake: torch.Tensor) -> torch.Tensor | None:
        base = self._real.get(fake.untyped_storage())
        if base is None:
            return None
        return base.as_strided(fake.shape, fake.stride(), fake.storage_offset())

    def __enter__(self):
        masking = sys.modules.get("transformers.masking_utils")
        self._patch = None
        if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
            original = masking.find_packed_sequence_indices

            def find_packed_sequence_indices(position_ids):
                if torch.compiler.is_compiling():  # traced by dynamo (compile): the real run traces the original
                    return original(position_ids)
                found = original(position_ids)  # on the fake tensor: the real run's temporaries
                if found is None or not isinstance(position_ids, torch.Tensor):
                    return found
                with _disable_current_modes():  # real values, outside the fake mode and the ledger
                    real = self._values(position_ids)
                    packed = real is not None and original(real) is not None
                if real is None:
                    self.unknown += position_ids.untyped_storage() in self._batch
                return found if packed else None

            self._patch = patched(masking, "find_packed_sequence_indices", find_packed_sequence_indices)
            self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        if self._patch is not None:
            self._patch.__exit__(*exc)
        return False
