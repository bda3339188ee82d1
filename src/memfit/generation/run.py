"""``run_generate``: one Hugging Face ``generate`` as the estimate and the truth both run it.

Greedy decoding of exactly ``new_tokens`` tokens: ``eos_token_id=None``, so no sequence finishes early
(the longest generation the request allows, which is what memory has to hold), ``pad_token_id`` set,
``do_sample=False``, one beam. The model is put in eval mode (no dropout), as ``from_pretrained``
leaves it; ``generate`` runs under ``torch.no_grad`` itself.

A ``watch`` (the ledger, or ``Quiet``) hears where the run is: ``prefill`` from the start (an
encoder-decoder model's encoder, and ``generate``'s own set-up, belong to it), then ``decode`` step k
as the k-th forward after the first begins (a forward pre-hook on the model counts them); after each
forward the cache object's tensors are marked ``kv_cache`` (a forward hook reads the cache the model
was handed), and the model's weights ``parameters`` again (a weight a forward replaced is still one).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from memfit.categories import Category
from memfit.generation.cache import cache_kwargs, cache_tensors, find_cache
from memfit.techniques.apply import Quiet
from memfit.techniques.lora import quant_state_tensors

__all__ = ["Request", "run_generate", "prompt_batch", "vocab_size"]


@dataclasses.dataclass(frozen=True)
class Request:
    """What one generation asks for."""
    prompt_len: int  # tokens of each prompt (the longest, with padding)
    new_tokens: int  # tokens generated after the prompt, exactly
    batch_size: int = 1  # prompts generated together
    cache: str = "dynamic"  # a value of ``cache.CACHES``
    padding: bool = False  # left padding: row i (of batch_size > 1) is i * prompt_len // (2 * batch_size) shorter
    logits_to_keep: int | None = None  # None: generate's own choice (1: the last position's logits only)


def prompt_batch(request: Request, vocab_size: int) -> dict[str, torch.Tensor]:
    """The prompt as real CPU tensors: ids (deterministic, never the pad id 0) and the attention mask,
    left-padded with ``padding`` (each row but the first shorter, none empty)."""
    rows, length = request.batch_size, request.prompt_len
    ids = (torch.arange(rows * length, dtype=torch.long).reshape(rows, length) * 7919) % max(vocab_size - 1, 1) + 1
    mask = torch.ones(rows, length, dtype=torch.long)
    if request.padding:
        for row in range(1, rows):
            pad = min(row * length // (2 * rows), length - 1)
            mask[row, :pad] = 0
            ids[row, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run_generate(model: torch.nn.Module, prompt: dict, request: Request, *, watch=None) -> torch.Tensor:
    """``model.generate`` on ``prompt`` (input_ids and attention_mask) as ``request`` says; the ids it returns.
    ``watch``: told the phases and the cache's tensors (``Quiet`` by default)."""
    watch = watch or Quiet()
    config = model.config
    kwargs = dict(max_new_tokens=request.new_tokens, do_sample=False, num_beams=1, eos_token_id=None,
                  pad_token_id=_pad_id(config))
    kwargs.update(cache_kwargs(request.cache, encoder_decoder=config.is_encoder_decoder))
    if request.logits_to_keep is not None:
        kwargs["logits_to_keep"] = request.logits_to_keep
    was_training = model.training
    model.eval()
    try:
        with _watched(model, watch):
            return model.generate(**prompt, **kwargs)
    finally:
        model.train(was_training)


def vocab_size(config) -> int:
    """Token ids of the model's (decoder's) vocabulary."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 2)


def _pad_id(config) -> int:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for source in (config, text):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


@contextlib.contextmanager
def _watched(model: torch.nn.Module, watch):
    """Phases and cache marks for ``watch`` while ``model`` generates; the hooks removed after."""
    calls = 0

    def before(module, args, kwargs):
        nonlocal calls
        if calls:
            watch.begin("decode", calls)
        calls += 1

    def after(module, args, kwargs, output):
        cache = find_cache(kwargs, output)
        if cache is not None:
            for tensor in cache_tensors(cache):
                watch.mark(tensor, Category.KV_CACHE)
        # weights a forward replaced (bitsandbytes repacks a 4-bit weight for the CPU in its first eval
        # forward) are still the model's parameters
        for tensor in list(model.parameters()) + quant_state_tensors(model):
            watch.mark(tensor, Category.PARAMETERS)

    if isinstance(watch, Quiet):  # nobody listens: the truth runs generate without hooks
        yield
        return
    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True)]
    watch.begin("prefill", 0)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
