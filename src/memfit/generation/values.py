"""``KnownValues``: small tensors of a fake generation carry their real values beside them.

``generate`` decides its control flow by reading tensors: whether the attention mask has padding
(``(mask == 1).all()``, masking_utils' ``fast_all``), whether every sequence is finished
(``unfinished_sequences.max() == 0``), where the positions of a left-padded row start. Fake tensors
have no values, and ``estimator.fake.ScalarReads`` answers every read with the common branch of a
training step (no padding, a count of zero), which here would stop generation after one token and
never build a padding mask.

The values those reads depend on come from the prompt (ids and mask, which the estimate makes itself)
and from shapes and counters, never from the model's weights. So every op whose tensor inputs all have
known values, and whose outputs are small, is also run on those values, on real CPU tensors, with
every dispatch mode off (the ledger does not see it: it is not the step's memory); a read of a tensor
with a known value returns it. A value that derives from the weights (the argmax of the logits, the
generated ids) is unknown, and its reads fall back to ``ScalarReads``' answers. Values follow
in-place ops; a write into a tensor from an unknown value forgets its storage's value.

Left out: tensors of more than ``limit`` elements (the prompt's size or ``LIMIT``, whichever is larger:
hidden states and logits, never read for control flow), ops of other namespaces than aten, random ops, and
ops that fail on real CPU tensors: their outputs are simply unknown.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from memfit.estimator.fake import ScalarReads
from memfit.scoped import rng_hop_rules

__all__ = ["KnownValues", "LIMIT"]

# Outputs of more elements than this carry no value (unless the prompt is larger: ``KnownValues(limit)``): the
# prompt's mask and a decode step's 4-D mask fit, logits and hidden states do not.
LIMIT = 1 << 20
_READ = torch.ops.aten._local_scalar_dense.default
_RANDOM = ("rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "normal", "uniform", "exponential")


class KnownValues(ScalarReads):
    """``ScalarReads`` whose reads of tensors with a known value return that value (see the module).

    ``known(tensor, value)`` seeds a value (the prompt's ids and mask); ``answered`` counts reads
    answered from a value, ``reads`` (``ScalarReads``) those answered by the training-step default."""

    def __init__(self, limit: int = LIMIT, kernels=None):
        super().__init__(kernels)
        self.limit = limit
        self.answered = 0
        self._values = WeakIdKeyDictionary()  # fake tensor -> real tensor of its value
        self._stale = WeakIdKeyDictionary()  # storages written from unknown values

    def known(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        self._values[tensor] = value.detach().clone()

    def value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The real value of ``tensor`` if known (its storage not written since from unknown values); a real
        tensor (``torch.tensor(data)`` entering the fake mode through ``lift_fresh``) is its own."""
        if not isinstance(tensor, FakeTensor):
            return tensor
        value = self._values.get(tensor)
        if value is None or tensor.untyped_storage() in self._stale:
            return None
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _READ:
            value = self.value(args[0])
            if value is not None:
                self.answered += 1
                with _disable_current_modes():
                    return value.item()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._follow(func, args, kwargs, out)
        return out

    def _follow(self, func, args, kwargs, out) -> None:
        """Run ``func`` on the known values of its inputs, and remember the values of its outputs."""
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        written = [a for a, spec in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write]
        values = [self.value(t) for t in tensors]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        small = all(t.numel() <= self.limit for t in outs) and all(t.numel() <= self.limit for t in tensors)
        if any(v is None for v in values) or not small or func.namespace != "aten" \
                or any(word in func.__name__ for word in _RANDOM):
            for tensor in written:  # its value, and that of every view of its storage, is now unknown
                self._stale[tensor.untyped_storage()] = True
            return
        lookup = {id(t): v for t, v in zip(tensors, values)}
        try:
            with _disable_current_modes():
                real = func(*tree_map(lambda x: lookup.get(id(x), x), args),
                            **tree_map(lambda x: lookup.get(id(x), x), kwargs))
        except Exception:  # noqa: BLE001 — an op real CPU tensors cannot run: its outputs stay unknown
            for tensor in written:
                self._stale[tensor.untyped_storage()] = True
            return
        for fake, value in zip(outs, [t for t in tree_flatten(real)[0] if isinstance(t, torch.Tensor)]):
            if fake.shape == value.shape:
                self._values[fake] = value


rng_hop_rules(KnownValues)
