"""``EngineCache``: the planner's traces, kept by the caller between ``plan`` and ``fit`` calls.

An ``Engine`` (``compose.py``) holds the traces of one model, batch and step and the full estimates
it made; a budget sweep (the same model planned under several budgets) needs the same ones each
time. A caller that makes several calls passes one cache to all of them; without one, each call
makes its own and traces from scratch.
"""

from __future__ import annotations

from memfit.planner.compose import Engine

__all__ = ["EngineCache"]


class EngineCache:
    """The engines of recent calls (at most ``size``, oldest dropped first), by model, batch and step.

    Only config models are kept (their key is the config's text): a module or a batch could change
    between calls without a visible difference. On a GPU target one engine serves every global batch
    size: its traces run a batch of a prime number of rows (``Engine.prime``) and its full estimates
    are of recipes (micro-batch and accumulation), so none depends on the global batch; the engine
    takes each call's, as it takes its progress. On the CPU (two batch sizes traced, the larger the
    global batch) the global batch size is part of the key."""

    def __init__(self, size: int = 4):
        self.size = size
        self._engines: dict = {}

    def __len__(self) -> int:
        return len(self._engines)

    def clear(self) -> None:
        self._engines.clear()

    def key(self, source, batch, target, seq_len, loss_fn, optimizer, global_batch_size):
        """What makes two calls' engines the same (None: not kept): a config model's text and the step's settings."""
        if source.config is None or batch is not None or source.module is not None:
            return None
        return (source.config.to_json_string(), source.task, None if target is None else target.name, seq_len,
                loss_fn, optimizer, global_batch_size if target is None else None)

    def engine(self, source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress) -> Engine:
        """An engine with the traces already made for the same model, batch and step, if any; its
        progress callable, notes and trace count are this call's."""
        key = self.key(source, batch, target, seq_len, loss_fn, optimizer, global_batch_size)
        engine = self._engines.get(key) if key is not None else None
        if engine is None:
            engine = Engine(source, batch, target, seq_len, loss_fn, optimizer, global_batch_size, progress)
            if key is not None:
                while len(self._engines) >= self.size:
                    self._engines.pop(next(iter(self._engines)))
                self._engines[key] = engine
        engine.progress, engine.notes, engine.traces = progress, [], 0
        engine.global_batch_size = global_batch_size
        return engine
