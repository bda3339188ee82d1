"""The spellings people type for a flag's value, read as the value they mean: argparse ``type`` functions.

Only where one reading is obvious: ``--lora 16`` (LoRA of rank 16), ``--checkpointing full`` (torchtitan's
word for every block), ``--precision bf16-true`` (Lightning's), ``--parallel FSDP``, ``--compile true``,
``--lora-dtype bfloat16``. A word that is not one of
them passes through unchanged, so the Recipe's (or argparse's) one-line error still names the values it takes.
Left out on purpose, with an error that says why: ``--seq-len 4k`` (4096 tokens to most, 4000 to vLLM's
``--max-model-len``). Left as they were: ``--precision bfloat16`` (pure bf16, or bf16-mixed?) and a bare
``--budget 24`` (bytes, as ``units.parse_size`` reads every plain integer).
"""

from __future__ import annotations

import argparse
import re

from memfit.errors import shown

__all__ = ["thousands", "lora", "checkpointing", "precision", "choice", "dtypes", "switch"]

TRUE = ("true", "yes", "on", "1")
FALSE = ("false", "no", "off", "0")
# torch's dtype names for memfit's short ones (lora_dtype, mixed_precision)
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
# other names of a closed field's values: memfit's fsdp is FSDP2 (fully_shard)
ALIASES = {"fsdp2": "fsdp"}
# Lightning's precision strings (Trainer(precision=...)) and the Recipe's value each means
LIGHTNING = {"32": "fp32", "32-true": "fp32", "16-mixed": "fp16-mixed", "bf16-true": "bf16"}
_THOUSANDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,3})?[kK]")


def thousands(text: str) -> None:
    """Refuse a token count written ``4k``, with its reason: 4096 to most, 4000 to vLLM's ``--max-model-len``."""
    word = text.strip()
    if _THOUSANDS.fullmatch(word):
        value = float(word[:-1]) * 1024
        raise argparse.ArgumentTypeError(f"{shown(text)} is ambiguous ({value * 1000 / 1024:.0f} or {value:.0f} "
                                         f"tokens?): write the number, e.g. {value:.0f}")


def lora(text: str) -> str:
    """``--lora 16`` is ``lora:16``; ``LoRA``/``QLoRA:64`` in any case; true/false are lora/off."""
    word = text.strip().lower()
    if word.isdigit():
        return f"lora:{word}"
    return "lora" if word in TRUE[:3] else "off" if word in ("false", "no", "none") else word


def checkpointing(text: str) -> str:
    """true/on/full (every block, as torchtitan's mode full and transformers' gradient_checkpointing) are
    ``blocks``; false/none are ``off``; ``modules:`` keeps its names' case."""
    word = text.strip()
    if word.lower() in (*TRUE[:3], "full", "all"):
        return "blocks"
    if word.lower() in (*FALSE[:3], "none"):
        return "off"
    return word.lower() if ":" not in word else word


def choice(choices: tuple):
    """One of ``choices`` in any case, ``_`` for ``-`` (``--attention SDPA``, ``--offload cpu_unpinned``)."""
    def read(text: str) -> str:
        word = text.strip().lower()
        word = ALIASES.get(word, word)
        return next((c for c in choices if c in (word, word.replace("_", "-"))), text)
    return read


def precision(text: str) -> str:
    """Any case, ``_`` for ``-``, and Lightning's names (``bf16-true``, ``16-mixed``, ``32``) as the Recipe's."""
    word = text.strip().lower().replace("_", "-")
    return LIGHTNING.get(word, word)


def dtypes(text: str) -> str:
    """torch's dtype names as memfit's: ``bfloat16`` -> ``bf16``, ``bfloat16:float32`` -> ``bf16:fp32``."""
    words = text.strip().lower().split(":")
    return ":".join(DTYPES.get(word, word) for word in words) if all(words) else text


def switch(choices: tuple):
    """A true/false field that also takes words (``compile``: layers): true/yes/on/1, false/no/off/0, or one
    of ``choices``."""
    def read(text: str):
        word = text.strip().lower()
        if word in TRUE:
            return True
        if word in FALSE:
            return False
        if word in choices:
            return word
        raise argparse.ArgumentTypeError(f"{shown(text)} is not one of true, false, {', '.join(choices)}")
    return read
