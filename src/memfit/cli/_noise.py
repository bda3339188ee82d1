"""Third-party noise the ``memfit`` command hides: each entry one known line, matched precisely.

The libraries memfit drives (transformers, peft, bitsandbytes, torchao) print lines about their own
internals while memfit builds models on fake tensors; on stderr they bury the table or the one-line
error. Nothing here is a blanket filter: a warning or a log line not listed (a user's own, or a
library's about the user's input) is shown as Python would show it. Each entry says where the line
comes from and why it is not the user's concern. Library code (``import memfit``) filters nothing.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

__all__ = ["WARNINGS", "LOG_LINES", "quiet"]

# (category, regex the message starts with, where from and why hidden): ``warnings.warn`` lines
WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (FutureWarning, r"`rope_scaling` is deprecated",
     "transformers (>= 5) reading an old-style rope_scaling of a user's config.json: it converts the field itself; "
     "a bad value still gets memfit's one-line error"),
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated",
     "transformers (>= 5) deprecates PreTrainedModel.is_gradient_checkpointing in its modeling_utils.py; peft "
     "reads it (PeftModel, prepare_model_for_kbit_training) on every LoRA model memfit builds, once per trace, "
     "so a plan printed it dozens of times; nothing the user can change"),
    (UserWarning, r"fan_in_fan_out is set to False but the target module is `Conv1D`",
     "peft, for GPT-2-style Conv1D layers: memfit's LoRA targets them by name and peft sets fan_in_fan_out "
     "itself, as the warning says; the model is right"),
    (UserWarning, r"FSDP2-wrapped module \(FSDPStage\) returned a view tensor",
     "torch 2.13's FSDP2 about memfit's pipeline stage under sequence parallel: the stage hands the next stage its "
     "local shard of the residual stream (DTensor.to_local(), a view), as torchtitan's stages do; nothing writes "
     "it in place (the schedule sends it), so the pre-backward hook it warns about is never dropped"),
    (FutureWarning, r"`torch\.utils\._pytree\._register_pytree_node` is deprecated",
     "torch, about pytree registrations an installed torchao makes at import (transformers imports it)"),
)

# (logger name, regex the message starts with, where from and why hidden): ``logging`` lines
LOG_LINES: tuple[tuple[str, str, str], ...] = (
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community",
     "bitsandbytes at import (peft's LoRA imports it), on CPUs with AVX512-BF16, when the optional `kernels` "
     "package is absent: a faster CPU kernel memfit never runs (it traces on fake tensors)"),
    ("transformers.modeling_utils", r"`loss_type=None` was set in the config but it is unrecognized",
     "transformers, when a config sets no loss_type (every catalog config): it uses the model's default "
     "loss, which is what memfit traces; an unrecognized loss_type the user set is still shown"),
    ("torchao", r"Skipping import of cpp extensions",
     "torchao at import (transformers imports it when installed), when its CUDA/C++ kernels do not match "
     "the installed torch: memfit does not run them"),
    ("torchao", r"Failed to load \S+\.so: Could not load this library",
     "torchao 0.18 at import (peft imports it when installed): its prebuilt CUDA extensions (mxfp8, cutlass "
     "sm90a) do not load on a CPU build of torch; memfit runs only torchao's PyTorch optimizers"),
    ("torchao.kernel.intmm", r"Warning: Detected no triton",
     "torchao at import without triton (CPU builds of torch): its int-matmul kernels, which memfit never runs"),
    ("torch.utils._pytree", r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile",
     "torch 2.13 about enum registrations torchao 0.18 makes at import (KernelPreference, ScaleCalculationMode): "
     "a deprecation inside torchao, nothing the user can change"),
)


class _Drop(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


@contextlib.contextmanager
def quiet():
    """While a verb runs: the listed warnings ignored, the listed log lines dropped; restored after."""
    added = []
    with warnings.catch_warnings():
        for category, message, _why in WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        for name, message, _why in LOG_LINES:
            logger, drop = logging.getLogger(name), _Drop(message)
            logger.addFilter(drop)
            added.append((logger, drop))
        try:
            yield
        finally:
            for logger, drop in added:
                logger.removeFilter(drop)
