"""memfit: make PyTorch training fit in the GPU memory you have.

    import memfit
    report = memfit.estimate("llama-3.1-8b", seq_len=2048)   # fake tensors: no memory, no GPU
    print(report.peak_bytes, report.by_category)

``import memfit`` is quick and silent: each public name imports its module (and torch) the first
time it is used, so ``memfit --help`` and ``memfit gpus`` do not load torch they do not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# kineto's two lines per profiler start are silenced only while memfit starts one (memfit.scoped).

__all__ = [
    "Category", "Data", "Fit", "Hardware", "MemfitError", "NoBatchFits", "NothingFits", "Plan", "Plans", "Recipe", "Report", "apply",
    "estimate", "estimate_generate", "estimate_micro_batch", "estimate_script", "ScriptFailed", "fit", "measure", "profile", "Profile",
    "longest", "Longest", "NoLengthFits",
    "parse_size", "plan", "format_size", "train", "read_trainer_config", "TrainerConfig",
]
__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "apply": "memfit.techniques.apply",
    "Category": "memfit.categories",
    "MemfitError": "memfit.errors",
    # where a step runs and what it runs on: estimate, plan and fit take them (hardware=, data=)
    "Hardware": "memfit.estimator.inputs", "Data": "memfit.estimator.inputs",
    # estimate: every workload, training and forward (memfit.estimator) and generate (memfit.generation)
    "estimate": "memfit.generation.workloads", "estimate_micro_batch": "memfit.estimator.estimate",
    "estimate_generate": "memfit.generation.generate",
    # a user's own script (``memfit estimate train.py``)
    "estimate_script": "memfit.script.estimate", "ScriptFailed": "memfit.script.estimate",
    "Fit": "memfit.planner.fit", "NoBatchFits": "memfit.planner.fit", "fit": "memfit.planner.fit",
    "longest": "memfit.planner.longest", "Longest": "memfit.planner.longest", "NoLengthFits": "memfit.planner.longest",
    "measure": "memfit.estimator.measure",
    "NothingFits": "memfit.planner.plan", "Plan": "memfit.planner.plan", "Plans": "memfit.planner.plan",
    "plan": "memfit.planner.plan",
    "profile": "memfit.profiling.profile", "Profile": "memfit.profiling.profile",
    "Recipe": "memfit.techniques.recipe",
    "Report": "memfit.report.report",
    "format_size": "memfit.units", "parse_size": "memfit.units",
    "train": "memfit.training.loop",
    "read_trainer_config": "memfit.trainers.read", "TrainerConfig": "memfit.trainers.read",
}
assert set(_WHERE) == set(__all__)

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time __getattr__ below imports on first use
    from memfit.categories import Category
    from memfit.errors import MemfitError
    from memfit.estimator.estimate import estimate_micro_batch
    from memfit.estimator.inputs import Data, Hardware
    from memfit.generation.generate import estimate_generate
    from memfit.generation.workloads import estimate
    from memfit.estimator.measure import measure
    from memfit.planner.fit import Fit, NoBatchFits, fit
    from memfit.planner.longest import Longest, NoLengthFits, longest
    from memfit.planner.plan import NothingFits, Plan, Plans, plan
    from memfit.profiling.profile import Profile, profile
    from memfit.script.estimate import ScriptFailed, estimate_script
    from memfit.report.report import Report
    from memfit.techniques.apply import apply
    from memfit.techniques.recipe import Recipe
    from memfit.training.loop import train
    from memfit.trainers.read import TrainerConfig, read_trainer_config
    from memfit.units import format_size, parse_size


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
