"""memfit: make PyTorch training fit in the GPU memory you have.

    import memfit
    report = memfit.estimate("llama-3.1-8b", seq_len=2048)   # fake tensors: no memory, no GPU
    print(report.peak_bytes, report.by_category)
"""

from memfit.categories import Category
from memfit.errors import MemfitError
from memfit.estimate import estimate
from memfit.measure import measure
from memfit.report import Report
from memfit.units import format_size, parse_size

__all__ = ["Category", "MemfitError", "Report", "estimate", "measure", "parse_size", "format_size"]
__version__ = "0.1.0"
