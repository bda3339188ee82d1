import os

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

try:
    from transformers.utils import logging

    logging.set_verbosity_error()
except ImportError:  # pragma: no cover
    pass
