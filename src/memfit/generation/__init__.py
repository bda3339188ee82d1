"""Inference: the memory of a generation (weights, KV cache, sampling temporaries). Empty until that
lands; it sits beside ``training``: above ``estimator``, below ``cli``."""
