"""Well-known architectures as config hyperparameters, built with random weights.

No hub access is needed: each entry is the handful of numbers from the model's published
``config.json`` that decide its memory (widths, depth, heads, vocabulary, tying). Weights are
random; memory does not depend on their values. Sources: the ``config.json`` files of the
official Hugging Face repositories named in each comment.

The older entries are written out below; newer ones (Qwen3, Qwen3-Next, Qwen3.5, Gemma 3, Llama 4,
DeepSeek-V3, gpt-oss, GLM-4.5, OLMo 3, SmolLM3, Granite 4, Phi-4, Mistral Small 3) are one JSON file
each in ``configs/``: the public config.json's memory-relevant fields and ``model_type``, plus a
``_memfit`` block (task, source repository, family, the card's parameter counts and notes). Where
the hub model is multimodal (Gemma 3 4B+, Llama 4, Qwen3.5) the entry is its text model. Parameter
counts (total, and active per token for MoE) are in ``configs/_counts.json`` (``counts.py``),
checked against fresh builds by ``tests/test_catalog.py``.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["CatalogEntry", "CATALOG", "CONFIGS", "lookup"]


@dataclass(frozen=True)
class CatalogEntry:
    model_type: str  # transformers' model_type
    task: str  # causal-lm | masked-lm | seq2seq | image-classification | speech-seq2seq | image-text-to-text
    config: dict = field(default_factory=dict)
    family: str = ""  # for ``memfit models --family``; the name up to its first "-" where not given
    source: str = ""  # the Hugging Face repository whose config.json the numbers are from
    published: dict = field(default_factory=dict)  # the card's counts and notes (``_memfit`` of a JSON entry)


def _llama(h, inter, layers, heads, kv, vocab, *, tied=False, pos=131072, theta=500000.0, **kw):
    return CatalogEntry("llama", "causal-lm", dict(
        hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        tie_word_embeddings=tied, max_position_embeddings=pos, rope_theta=theta,
        rms_norm_eps=1e-5, **kw))


def _qwen(h, inter, layers, heads, kv, vocab, tied):
    return CatalogEntry("qwen2", "causal-lm", dict(
        hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        tie_word_embeddings=tied, max_position_embeddings=32768, rms_norm_eps=1e-6))


def _gpt2(h, layers, heads):
    return CatalogEntry("gpt2", "causal-lm", dict(
        n_embd=h, n_layer=layers, n_head=heads, vocab_size=50257, n_positions=1024))


def _mamba(h, layers):
    return CatalogEntry("mamba", "causal-lm", dict(
        hidden_size=h, num_hidden_layers=layers, vocab_size=50280, state_size=16, expand=2, conv_kernel=4,
        time_step_rank=-(-h // 16), tie_word_embeddings=True))


def _whisper(d, layers, heads, ffn, vocab, mels):
    return CatalogEntry("whisper", "speech-seq2seq", dict(
        d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
        decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, vocab_size=vocab,
        num_mel_bins=mels, max_source_positions=1500, max_target_positions=448,
        decoder_start_token_id=50258, pad_token_id=50257, bos_token_id=50257, eos_token_id=50257))


CATALOG: dict[str, CatalogEntry] = {
    # openai-community/gpt2, gpt2-medium, gpt2-large, gpt2-xl
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    # meta-llama/Llama-2-{7b,13b,70b}-hf
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32, 32000, pos=4096, theta=10000.0),
    "llama-2-13b": _llama(5120, 13824, 40, 40, 40, 32000, pos=4096, theta=10000.0),
    "llama-2-70b": _llama(8192, 28672, 80, 64, 8, 32000, pos=4096, theta=10000.0),
    # meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, Llama-3.1-70B, Llama-3.3-70B-Instruct
    "llama-3.2-1b": _llama(2048, 8192, 16, 32, 8, 128256, tied=True, head_dim=64),
    "llama-3.2-3b": _llama(3072, 8192, 28, 24, 8, 128256, tied=True, head_dim=128),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 8, 128256),
    "llama-3.1-70b": _llama(8192, 28672, 80, 64, 8, 128256),
    "llama-3.3-70b": _llama(8192, 28672, 80, 64, 8, 128256),
    # meta-llama/Llama-3.1-405B (torchtitan's largest published row: FSDP8 x TP8 x PP8)
    "llama-3.1-405b": _llama(16384, 53248, 126, 128, 8, 128256),
    # mistralai/Mistral-7B-v0.1
    "mistral-7b": CatalogEntry("mistral", "causal-lm", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
        sliding_window=4096, rms_norm_eps=1e-5)),
    # Qwen/Qwen2.5-{0.5B,1.5B,3B,7B,14B,32B,72B}
    "qwen2.5-0.5b": _qwen(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": _qwen(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": _qwen(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": _qwen(3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": _qwen(5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": _qwen(5120, 27648, 64, 40, 8, 152064, False),
    "qwen2.5-72b": _qwen(8192, 29568, 80, 64, 8, 152064, False),
    # google/gemma-2-2b, gemma-2-9b
    "gemma-2-2b": CatalogEntry("gemma2", "causal-lm", dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096)),
    "gemma-2-9b": CatalogEntry("gemma2", "causal-lm", dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096)),
    # microsoft/Phi-3-mini-4k-instruct
    "phi-3-mini": CatalogEntry("phi3", "causal-lm", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
        pad_token_id=32000)),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": CatalogEntry("mixtral", "causal-lm", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, num_local_experts=8,
        num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # Qwen/Qwen1.5-MoE-A2.7B (60 routed experts, top-4, and a shared expert per layer)
    "qwen1.5-moe-a2.7b": CatalogEntry("qwen2_moe", "causal-lm", dict(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4, decoder_sparse_step=1,
        norm_topk_prob=False, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=151936, max_position_embeddings=8192, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    # Qwen/Qwen3-30B-A3B (128 routed experts, top-8, no shared expert)
    "qwen3-30b-a3b": CatalogEntry("qwen3_moe", "causal-lm", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # state-spaces/mamba-{130m,1.4b,2.8b}-hf
    "mamba-130m": _mamba(768, 24),
    "mamba-1.4b": _mamba(2048, 48),
    "mamba-2.8b": _mamba(2560, 64),
    # state-spaces/mamba2-1.3b (d_model 2048, n_layer 48, d_state 128, headdim 64, expand 2,
    # ngroups 1, chunk_size 256; vocabulary 50277 padded to a multiple of 16)
    "mamba2-1.3b": CatalogEntry("mamba2", "causal-lm", dict(
        hidden_size=2048, num_hidden_layers=48, state_size=128, head_dim=64, num_heads=64, expand=2,
        n_groups=1, chunk_size=256, conv_kernel=4, vocab_size=50288, tie_word_embeddings=True)),
    # openai/whisper-small, whisper-medium, whisper-large-v3
    "whisper-small": _whisper(768, 12, 12, 3072, 51865, 80),
    "whisper-medium": _whisper(1024, 24, 16, 4096, 51865, 80),
    "whisper-large-v3": _whisper(1280, 32, 20, 5120, 51866, 128),
    # llava-hf/llava-1.5-7b-hf (CLIP ViT-L/14 at 336 px + Vicuna-7B; 576 image tokens)
    "llava-1.5-7b": CatalogEntry("llava", "image-text-to-text", dict(
        text_config=dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                         max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
        vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
                           projection_dim=768, hidden_act="quick_gelu"),
        image_token_id=32000, image_seq_length=576, vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False)),
    # microsoft/phi-1_5 (partial rotary: half of each head)
    "phi-1.5": CatalogEntry("phi", "causal-lm", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=51200, partial_rotary_factor=0.5, max_position_embeddings=2048,
        hidden_act="gelu_new", layer_norm_eps=1e-5, tie_word_embeddings=False)),
    # google-bert/bert-base-uncased, bert-large-uncased
    "bert-base": CatalogEntry("bert", "masked-lm", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        vocab_size=30522)),
    "bert-large": CatalogEntry("bert", "masked-lm", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        vocab_size=30522)),
    # google-t5/t5-small, t5-base
    "t5-small": CatalogEntry("t5", "seq2seq", dict(
        d_model=512, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8, d_kv=64,
        vocab_size=32128, decoder_start_token_id=0)),
    "t5-base": CatalogEntry("t5", "seq2seq", dict(
        d_model=768, d_ff=3072, num_layers=12, num_decoder_layers=12, num_heads=12, d_kv=64,
        vocab_size=32128, decoder_start_token_id=0)),
    # google/vit-base-patch16-224, vit-large-patch16-224
    "vit-base": CatalogEntry("vit", "image-classification", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        image_size=224, patch_size=16, num_labels=1000)),
    "vit-large": CatalogEntry("vit", "image-classification", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        image_size=224, patch_size=16, num_labels=1000)),
    # google/vit-huge-patch14-224-in21k
    "vit-huge": CatalogEntry("vit", "image-classification", dict(
        hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
        image_size=224, patch_size=14, num_labels=1000)),
    # facebook/dinov2-giant (SwiGLU MLP: 2 x 4096 in, 4096 out; layer scale)
    "dinov2-giant": CatalogEntry("dinov2", "image-classification", dict(
        hidden_size=1536, num_hidden_layers=40, num_attention_heads=24, mlp_ratio=4, use_swiglu_ffn=True,
        image_size=518, patch_size=14, layerscale_value=1.0, layer_norm_eps=1e-6, qkv_bias=True,
        num_labels=1000, architectures=["Dinov2ForImageClassification"])),
}


CONFIGS = Path(__file__).with_name("configs")


def _from_file(path: Path) -> CatalogEntry:
    data = json.loads(path.read_text())
    meta = data.pop("_memfit")
    return CatalogEntry(data.pop("model_type"), meta.pop("task"), data, family=meta.pop("family"),
                        source=meta.pop("source"), published=meta)


CATALOG = {name: entry if entry.family else replace(entry, family=name.split("-")[0])
           for name, entry in CATALOG.items()}
CATALOG.update({path.stem: _from_file(path) for path in sorted(CONFIGS.glob("*.json"))
                if not path.name.startswith("_")})


def lookup(name: str) -> CatalogEntry:
    """The entry called ``name`` (case-insensitive), or an error naming the closest ones."""
    key = name.strip().lower()
    if key in CATALOG:
        return CATALOG[key]
    close = difflib.get_close_matches(key, CATALOG, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else "run `memfit models` for the list"
    raise MemfitError(f"unknown model {name!r}: {hint}")


def by_source(repo_id: str) -> tuple[str, CatalogEntry] | None:
    """The catalog's (name, entry) taken from Hugging Face repository ``repo_id`` (case-insensitive), if any."""
    key = repo_id.strip().lower()
    for name, entry in CATALOG.items():
        if entry.source and entry.source.lower() == key:
            return name, entry
    return None
