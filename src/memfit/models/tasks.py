"""Task heads: which head a config's ``architectures`` asks for, the Auto class that builds it, and
the labels that head trains on.

A ``config.json`` names its head in ``architectures`` (``BertForSequenceClassification``): that is
the model people fine-tune, and its memory differs from the masked LM the model type alone suggests
(a ``num_labels``-wide classifier instead of a vocabulary-wide decoder, and a loss over one label
per example). The made batch carries the labels transformers' own loss reads for that head:

====================  ==============================  =============================================
task                  Auto class                      labels
====================  ==============================  =============================================
sequence-classif.     AutoModelForSequenceClassif.    ``labels`` (batch,): class ids below ``num_labels``;
                                                      floats for regression (``num_labels == 1``) and
                                                      (batch, num_labels) floats for multi-label
token-classification  AutoModelForTokenClassification ``labels`` (batch, seq): class ids
question-answering    AutoModelForQuestionAnswering   ``start_positions``, ``end_positions`` (batch,)
image-classification  AutoModelForImageClassification ``pixel_values`` and ``labels`` (batch,)
====================  ==============================  =============================================

(causal and masked LMs and encoder-decoders train on ``input_ids`` + ``labels`` of the same shape:
``source.py``.) ``task_for`` gives a whole config's task: a family's own (``families.TASKS``), else its
``architectures``' head, else its model type's usual one, else a causal LM; ``head`` also readies the
config for it (below).

A decoder classifying by its last token (``LlamaForSequenceClassification``) finds that token through
``pad_token_id`` and refuses a batch above one without it; a config without one gets
``eos_token_id`` (or 0), as fine-tuning scripts set ``model.config.pad_token_id``.

Written by hand: transformers maps architectures to Auto classes only by model type
(``MODEL_FOR_..._MAPPING_NAMES``), and makes no example batches.
"""

from __future__ import annotations

import copy

import torch

from memfit.errors import MemfitError
from memfit.models import families

__all__ = ["head", "task_for", "task_of", "AUTO_CLASSES", "LABELLED", "labelled_batch", "with_pad_token", "vocab_size"]

# architecture name suffix -> task (first match wins)
_SUFFIXES = (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
             ("ForSequenceClassification", "sequence-classification"),
             ("ForTokenClassification", "token-classification"), ("ForQuestionAnswering", "question-answering"),
             ("ForConditionalGeneration", "seq2seq"), ("ForImageClassification", "image-classification"))

# task -> the transformers Auto class that builds its head
AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "image-classification": "AutoModelForImageClassification",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "image-text-to-text": "AutoModelForImageTextToText",
}


# task -> transformers' own list of the head classes its Auto class builds (modeling_auto), read
# before the suffixes: ``FlaubertWithLMHeadModel`` is a masked LM, ``MarianMTModel`` and
# ``EncoderDecoderModel`` are encoder-decoders, though their names do not say so. A class in
# several lists (``BartForConditionalGeneration``: seq2seq and masked LM) takes the first.
_MAPPINGS = (("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
             ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
             ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
             ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
             ("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
             ("question-answering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
             ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"))


# model_type -> task, for a config whose architectures name no head (a config made in code, or trimmed)
_MODEL_TYPES = {"bert": "masked-lm", "distilbert": "masked-lm", "roberta": "masked-lm", "xlm-roberta": "masked-lm",
                "albert": "masked-lm", "electra": "masked-lm", "deberta": "masked-lm", "deberta-v2": "masked-lm",
                "modernbert": "masked-lm", "t5": "seq2seq", "bart": "seq2seq", "vit": "image-classification"}


def head(config, task: str | None = None) -> tuple[str, object]:
    """(task, config) of a Hugging Face config about to be built: ``task`` where it is known (a catalog
    entry's), else the config's own (``task_for``); the config readied for that head (``with_pad_token``)."""
    task = task or task_for(config)
    return task, with_pad_token(config, task)


def task_for(config) -> str:
    """The task a Hugging Face config trains for (see the module's docstring); refuses multimodal inputs
    memfit cannot make a batch for."""
    if config.model_type in families.TASKS:
        return families.TASKS[config.model_type]
    if hasattr(config, "vision_config") or hasattr(config, "audio_config"):
        raise MemfitError(f"memfit cannot make a batch for {config.model_type} (multimodal inputs): pass a factory "
                          "and batch=, e.g. estimate(lambda: Model(config), batch)")
    return task_of(getattr(config, "architectures", None)) or _MODEL_TYPES.get(config.model_type, "causal-lm")


def task_of(architectures) -> str | None:
    """The task of the first architecture name transformers maps to a head, else of the first with
    a known head suffix, or None."""
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, (list, tuple)) else []
    for arch in names:
        task = _mapped_task(arch)
        if task is not None:
            return task
    for arch in names:
        for suffix, task in _SUFFIXES:
            if arch.endswith(suffix):
                return task
    return None


def _mapped_task(arch: str) -> str | None:
    from transformers.models.auto import modeling_auto

    for task, attr in _MAPPINGS:
        for value in getattr(modeling_auto, attr, {}).values():
            if arch == value or (isinstance(value, (list, tuple)) and arch in value):
                return task
    return None


def vocab_size(config, name: str) -> int:
    """The token vocabulary a made batch draws ids from: the config's own, else its text model's
    (a composite config such as ``EncoderDecoderConfig`` keeps it in the decoder's)."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) and hasattr(config, "get_text_config"):
        vocab = getattr(config.get_text_config(decoder=True), "vocab_size", None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise MemfitError(f"{name}: the config gives no vocab_size to draw token ids from: set vocab_size in "
                          "the config or pass batch=")
    return vocab


def with_pad_token(config, task: str):
    """``config``, or a copy with a padding id where a sequence classifier needs one to find the last token."""
    if task != "sequence-classification" or getattr(config, "pad_token_id", None) is not None:
        return config
    config = copy.deepcopy(config)
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    config.pad_token_id = eos if isinstance(eos, int) and 0 <= eos < config.vocab_size else 0
    return config


def _class_labels(config, rows: int, *shape) -> torch.Tensor:
    problem = getattr(config, "problem_type", None)
    if problem == "regression" or (problem is None and config.num_labels == 1):
        return torch.randn(rows, *shape)
    if problem == "multi_label_classification":
        return torch.randint(0, 2, (rows, *shape, config.num_labels)).float()
    return torch.randint(0, config.num_labels, (rows, *shape))


def _text(config, batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab_size(config, config.model_type), (batch_size, seq_len))


def _sequence(config, batch_size: int, seq_len: int) -> dict:
    return {"input_ids": _text(config, batch_size, seq_len), "labels": _class_labels(config, batch_size)}


def _token(config, batch_size: int, seq_len: int) -> dict:
    return {"input_ids": _text(config, batch_size, seq_len),
            "labels": torch.randint(0, config.num_labels, (batch_size, seq_len))}


def _answer(config, batch_size: int, seq_len: int) -> dict:
    return {"input_ids": _text(config, batch_size, seq_len),
            "start_positions": torch.randint(0, seq_len, (batch_size,)),
            "end_positions": torch.randint(0, seq_len, (batch_size,))}


def _image(config, batch_size: int, seq_len) -> dict:
    size = config.image_size
    return {"pixel_values": torch.randn(batch_size, config.num_channels, size, size),
            "labels": _class_labels(config, batch_size)}


# task -> batch(config, batch_size, seq_len) for the heads whose labels are not the input tokens
LABELLED = {"sequence-classification": _sequence, "token-classification": _token,
            "question-answering": _answer, "image-classification": _image}


def labelled_batch(config, task: str, batch_size: int, seq_len) -> dict:
    """A batch for the head of ``task`` (one of ``LABELLED``), built in the current device / fake mode."""
    return LABELLED[task](config, batch_size, seq_len)
