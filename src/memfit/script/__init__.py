"""A user's own, unchanged training script, estimated for a card on fake tensors (``memfit estimate train.py``).

runner.py    runs a script or module as ``python`` would (argv, ``__main__``, ``sys.path``).
device.py    the script's ``cuda`` answered as the card: fake CPU tensors marked the card's, ``torch.cuda``,
             amp and the optimizers' choice of implementation.
files.py     weights never read (``from_pretrained`` from the config), nothing written, offline.
estimate.py  ``estimate_script``: the run under the profiler's watch on fake tensors, stopped after N steps.
answer.py    the Report: the card's side replayed by the caching allocator, the peak's and the OOM's line.
"""

from memfit.script.estimate import DEFAULT_STEPS, ScriptFailed, estimate_script

__all__ = ["estimate_script", "ScriptFailed", "DEFAULT_STEPS"]
