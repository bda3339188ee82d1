"""Sharding over many GPUs: FSDP2 wrapping, per-rank estimates, torchrun launch. Empty until that lands;
it sits beside ``training``: above ``planner``, below ``cli``."""
