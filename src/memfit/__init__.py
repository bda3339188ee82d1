"""memfit: make PyTorch training fit in the GPU memory you have.

    import memfit
    report = memfit.estimate("llama-3.1-8b", seq_len=2048)   # fake tensors: no memory, no GPU
    print(report.peak_bytes, report.by_category)
"""

# kineto's two lines per profiler start are silenced only while memfit starts one (memfit.scoped).
from memfit.techniques.apply import apply
from memfit.categories import Category
from memfit.errors import MemfitError
from memfit.estimator.estimate import estimate
from memfit.planner.fit import Fit, NoBatchFits, fit
from memfit.estimator.measure import measure
from memfit.planner.plan import NothingFits, Plan, Plans, plan
from memfit.techniques.recipe import Recipe
from memfit.report.report import Report
from memfit.units import format_size, parse_size

__all__ = [
    "Category", "Fit", "MemfitError", "NoBatchFits", "NothingFits", "Plan", "Plans", "Recipe", "Report", "apply",
    "estimate", "fit", "measure",
    "parse_size", "plan", "format_size",
]
__version__ = "0.1.0"
