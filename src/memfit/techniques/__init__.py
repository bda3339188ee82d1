"""One module per memory technique, each declaring itself (``spec.py``); ``memfit.apply`` composes
them in their declared order, ``Recipe`` takes its fields from them (``registry.py``).

A technique module defines ``TECHNIQUE = Technique(...)``: its Recipe field(s), their values and
default, the CLI flag and help, its place in apply's order and what it does there, the values the
planner searches, what it conflicts with, and whether it changes the math. No technique imports
another's implementation: each is a transform of the model, the loss, the optimizer or the step.
"""
