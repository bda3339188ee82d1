"""What an estimate or a profile says: the ``Report`` (``report.py``), its tables (``tables.py``) and its
pictures (``pictures.py``: interactive HTML and PNG; plotly and matplotlib are imported only there)."""

from memfit.report.report import Report

__all__ = ["Report"]
