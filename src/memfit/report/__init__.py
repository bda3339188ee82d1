"""What an estimate says: the ``Report`` (``report.py``) and its tables (``tables.py``); later, pictures."""

from memfit.report.report import Report

__all__ = ["Report"]
