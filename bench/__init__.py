"""memfit's benches: scripts that measure memfit and write bench/results/*.json and the README's tables.

One folder per thing measured (each folder's docstring says which); one module per bench. A bench's
module docstring opens with its purpose in one line and names its ``RESULTS`` file(s); support
modules are ``_private``. ``python -m bench list`` shows them all, ``python -m bench NAME`` runs one
(bench/__main__.py); ``bench/_results.py`` writes every results file in one shape.
"""
