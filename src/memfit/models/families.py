"""What differs between model families when memfit makes a batch: the inputs a family trains on,
and how long a sequence its position table allows.

Most Hugging Face models train on ``input_ids`` + ``labels``. Two families need more:

- **speech encoder-decoders** (Whisper): ``input_features`` of shape (batch, mel bins,
  2 x ``max_source_positions``) — the encoder's two stride-2 convolutions leave exactly
  ``max_source_positions`` frames, and Whisper refuses any other length — plus decoder ``labels``
  of ``seq_len`` tokens (the decoder input is the labels shifted right, made by the model).
- **vision-language models** (LLaVA): ``pixel_values`` of one image per example, and
  ``input_ids`` whose first ``image_seq_length`` tokens are the image placeholder (where the
  projected image features are written), the rest text. ``seq_len`` counts both.

Position limits: a model with a *learned absolute* position table (GPT-2, BERT, DistilBERT,
RoBERTa, OPT, BART, Whisper's decoder) cannot embed positions past its table, and the failure a
longer batch gives is a broadcast or index error from deep inside the model. So a made batch
longer than the table is refused with one line naming the limit. Rotary (Llama, Mistral, GPT-J,
GPT-NeoX, ModernBERT, ...), ALiBi (BLOOM), relative (T5, DeBERTa) and position-free (Mamba) models have no such table:
their ``max_position_embeddings`` is a training length, not a limit, and is not enforced.
RoBERTa-style models start positions after the padding index, so their limit is the table size
minus ``pad_token_id + 1`` (514 - 2 = 512 for roberta-base).
"""

from __future__ import annotations

import torch

from memfit.errors import MemfitError

__all__ = ["TASKS", "BATCHES", "position_limit", "check_seq_len", "default_seq_len"]

# model_type -> task, where the architecture name alone would pick the wrong Auto class
# (Whisper and LLaVA are both "...ForConditionalGeneration", like T5).
TASKS = {"whisper": "speech-seq2seq", "llava": "image-text-to-text"}

_OFFSET_BY_PADDING = ("roberta", "xlm-roberta", "camembert", "longformer", "data2vec-text")


def position_limit(config, task: str | None = None) -> tuple[int, str] | None:
    """(longest sequence, the config field that sets it), or None where there is no table."""
    if config.model_type == "whisper":
        return config.max_target_positions, "max_target_positions"
    text = getattr(config, "text_config", None) or config
    if any(getattr(text, key, None) for key in ("rope_parameters", "rope_scaling", "rotary_dim", "alibi")):
        return None
    if getattr(text, "position_biased_input", True) is False:  # DeBERTa: relative positions only
        return None
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:  # XLNet's -1: no table
            if text.model_type in _OFFSET_BY_PADDING and isinstance(getattr(text, "pad_token_id", None), int):
                value -= text.pad_token_id + 1
            return value, key
    return None


def check_seq_len(config, task: str | None, seq_len: int, name: str) -> None:
    """Refuse a made batch longer than the model's position table (one line naming the limit)."""
    name = name.split("[", 1)[0]  # the model, not the depth fast path's shallow copy of it
    limit = position_limit(config, task)
    if limit is not None and seq_len > limit[0]:
        raise MemfitError(f"{name} has {limit[0]} positions ({limit[1]}), so seq_len={seq_len} cannot run: "
                          f"pass --seq-len {limit[0]} or less")
    if task == "image-text-to-text" and seq_len <= config.image_seq_length:
        raise MemfitError(f"{name} puts {config.image_seq_length} image tokens in every sequence: "
                          f"pass --seq-len above {config.image_seq_length}")


def default_seq_len(config, task: str | None) -> int:
    """The model's trained length (a limit or not), at most 512 for encoders and encoder-decoders,
    2048 otherwise; Whisper's decoder length; LLaVA's image tokens + 512."""
    if task == "image-text-to-text":
        return config.image_seq_length + 512
    if task == "speech-seq2seq":
        return config.max_target_positions
    trained = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions")
                    if isinstance(getattr(config, k, None), int) and getattr(config, k) > 0), 2048)
    limit = position_limit(config, task)
    return min(trained, limit[0] if limit else trained, 512 if task in ("masked-lm", "seq2seq") else 2048)


def _speech_batch(config, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    frames = 2 * config.max_source_positions
    labels = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return {"input_features": torch.randn(batch_size, config.num_mel_bins, frames), "labels": labels}


def _image_text_batch(config, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    vision = config.vision_config
    image = config.image_token_id
    text_vocab = min(config.text_config.vocab_size, image)  # text tokens never collide with the placeholder
    ids = torch.randint(0, text_vocab, (batch_size, seq_len))
    ids[:, : config.image_seq_length] = image
    labels = ids.clone()
    labels[:, : config.image_seq_length] = -100  # no loss on image positions, as LLaVA's collators do
    pixels = torch.randn(batch_size, vision.num_channels, vision.image_size, vision.image_size)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


BATCHES = {"speech-seq2seq": _speech_batch, "image-text-to-text": _image_text_batch}
