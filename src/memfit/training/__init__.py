"""The training loop that runs a plan (issue: ``memfit train``): OOM recovery, token-budget batching,
data, checkpoint and resume, Hugging Face Trainer integration. Empty until that lands; it sits above
``planner`` and ``estimator`` and below ``cli``."""
