import os

os.environ.setdefault("KINETO_LOG_LEVEL", "6")
# memfit answers in CUDA semantics by default (the GPU torch sees, else h100-sxm). Most tests grade an
# estimate against this CPU's own allocator, so the suite's default is the CPU's, as a user without a GPU
# can ask (MEMFIT_DEVICE=cpu); tests/test_gpu_default.py unsets it to test the default itself.
os.environ["MEMFIT_DEVICE"] = "cpu"

try:
    from transformers.utils import logging

    logging.set_verbosity_error()
except ImportError:  # pragma: no cover
    pass
