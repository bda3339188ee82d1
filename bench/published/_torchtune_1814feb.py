"""torchtune's Llama 3.2 3B and Llama 3.1 8B and 70B decoders as its README tables ran them, restated for
``bench/published/published.py``, which estimates torchtune's own model rather than a Hugging Face stand-in.

From pytorch/torchtune at 1814feb17 (BSD-3-Clause, the "Optimization flags" table's commit):
``modules/rms_norm.py``, ``modules/attention.py``, ``modules/feed_forward.py``, ``modules/transformer.py``
(``TransformerSelfAttentionLayer``, ``TransformerDecoder``), ``modules/tied_linear.py``,
``models/llama3_1/_position_embeddings.py`` (``Llama3ScaledRoPE``) and the two builders
(``models/llama3_2/_component_builders.py``, ``models/llama3_1/_component_builders.py``), trimmed to the training
forward (no KV cache, no cross-attention, no chunked-output mode: ``published.torchtune_loss`` applies the head).
The 8B table's commit (30b8519e8) expands k and v before their transpose instead of after: the same copies. The
ops are torchtune's, in its order, because which tensors each op saves is the memory; where Hugging Face's Llama
differs:

- ``RMSNorm`` upcasts, normalises and casts back before the scale (saves the fp32 input, the bf16 normalised);
- RoPE takes the fp32 table rows at each token's ``input_pos`` (a gather per call: packed documents restart their
  positions) and rotates in fp32; the table is built at init in fp32 and stays fp32 (torchtune builds under
  ``set_default_dtype(bf16)`` and never casts the model; memfit would make a buffer in the step's dtype, so the
  table is built at the decoder's first forward, on the step's device, and kept);
- k and v are expanded to every query head and copied (``expand(...).flatten(1, 2)``) before attention;
- one RoPE module is shared by all layers; the 3B's head is ``TiedLinear`` (``F.linear`` with the embedding).

Attention: with ``dataset.packed=True`` on a GPU of compute capability >= 7.5 torchtune runs flex attention with a
``BlockMask`` (``modules/attention_utils.py``); its saved set is q, k, v, the output (strided as q, so the
transpose back is a view) and the log-sum-exp, which is what SDPA's flash kernel saves for a causal mask: the
restatement calls SDPA with ``is_causal=True``. The document mask changes which scores are computed, not what is
kept. Left out: torchtune calls flex attention through ``torch.compiler.disable``, so a compiled layer is two graphs
around a separately compiled attention; with SDPA here it is one graph, whose partitioner may save a little
differently across the attention (the compiled 3B rows are within 0.3 %).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

# models/llama3_2/_model_builders.py llama3_2_3b and models/llama3_1/_model_builders.py llama3_1_8b, _70b, _405b at 1814feb17
CONFIGS = {
    "llama3_2_3b": dict(vocab_size=128_256, num_layers=28, num_heads=24, num_kv_heads=8, embed_dim=3072,
                        max_seq_len=131_072, intermediate_dim=8192, norm_eps=1e-5, rope_base=500_000,
                        scale_factor=32, tied=True),
    "llama3_1_8b": dict(vocab_size=128_256, num_layers=32, num_heads=32, num_kv_heads=8, embed_dim=4096,
                        max_seq_len=131_072, intermediate_dim=14_336, norm_eps=1e-5, rope_base=500_000,
                        scale_factor=8, tied=False),
    "llama3_1_70b": dict(vocab_size=128_256, num_layers=80, num_heads=64, num_kv_heads=8, embed_dim=8192,
                         max_seq_len=131_072, intermediate_dim=28_672, norm_eps=1e-5, rope_base=500_000,
                         scale_factor=8, tied=False),
    "llama3_1_405b": dict(vocab_size=128_256, num_layers=126, num_heads=128, num_kv_heads=8, embed_dim=16_384,
                          max_seq_len=8192, intermediate_dim=53_248, norm_eps=1e-5, rope_base=500_000,
                          scale_factor=8, tied=False),
}


class RMSNorm(nn.Module):  # modules/rms_norm.py
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_fp32 = x.float()
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return x_normed * self.scale


class Llama3ScaledRoPE(nn.Module):  # models/llama3_1/_position_embeddings.py
    def __init__(self, dim, max_seq_len, base, scale_factor, low_freq_factor=1, high_freq_factor=4,
                 old_context_len=8192):
        super().__init__()
        freqs = [1.0 / (base ** (i / dim)) for i in range(0, dim, 2)][: dim // 2]  # in Python: the model may be meta
        low_wavelen, high_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
        scaled = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                scaled.append(freq)
            elif wavelen > low_wavelen:
                scaled.append(freq / scale_factor)
            else:
                smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                scaled.append((1 - smooth) * freq / scale_factor + smooth * freq)
        self.scaled, self.max_seq_len, self.cache = scaled, max_seq_len, None

    def _build(self, device) -> None:
        """``rope_init``'s fp32 table of every position (torchtune builds it at init; here at the decoder's first
        forward, before its layers (outside any checkpoint), on the step's device: memfit would make a buffer in the
        step's dtype, and torchtune never casts these)."""
        theta = torch.tensor(self.scaled, dtype=torch.float32, device=device)
        seq_idx = torch.arange(self.max_seq_len, dtype=theta.dtype, device=device)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, theta).float()
        self.cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)

    def forward(self, x, *, input_pos=None):
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack([xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                             xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1]], -1)
        return x_out.flatten(3).type_as(x)


class MultiHeadAttention(nn.Module):  # modules/attention.py, self-attention in training
    def __init__(self, embed_dim, num_heads, num_kv_heads, head_dim, pos_embeddings):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.pos_embeddings = pos_embeddings

    def forward(self, x, *, input_pos=None):
        b, s_x, _ = x.shape
        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        q = self.pos_embeddings(q, input_pos=input_pos).transpose(1, 2)
        k = self.k_proj(x).view(b, s_x, -1, self.head_dim)
        v = self.v_proj(x).view(b, s_x, -1, self.head_dim)
        k = self.pos_embeddings(k, input_pos=input_pos).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)
        output = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flex attention's saved set (above)
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class FeedForward(nn.Module):  # modules/feed_forward.py with llama3_mlp's SiLU
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.activation = nn.SiLU()

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


class TransformerSelfAttentionLayer(nn.Module):  # modules/transformer.py
    def __init__(self, attn, mlp, sa_norm, mlp_norm):
        super().__init__()
        self.attn, self.mlp, self.sa_norm, self.mlp_norm = attn, mlp, sa_norm, mlp_norm

    def forward(self, x, *, input_pos=None):
        h = self.attn(self.sa_norm(x), input_pos=input_pos) + x
        return h + self.mlp(self.mlp_norm(h))


class TiedLinear:  # modules/tied_linear.py: not a module; F.linear with the embedding's weight
    def __init__(self, tied_module):
        self.tied_module = tied_module

    def __call__(self, x):
        return F.linear(x, self.tied_module.weight)


class TransformerDecoder(nn.Module):  # modules/transformer.py, up to the head
    def __init__(self, vocab_size, num_layers, num_heads, num_kv_heads, embed_dim, max_seq_len, intermediate_dim,
                 norm_eps, rope_base, scale_factor, tied):
        super().__init__()
        head_dim = embed_dim // num_heads
        self.rope = rope = Llama3ScaledRoPE(head_dim, max_seq_len, rope_base, scale_factor)  # one, shared by all layers
        self.tok_embeddings = nn.Embedding(vocab_size, embed_dim)
        self.layers = nn.ModuleList(
            TransformerSelfAttentionLayer(MultiHeadAttention(embed_dim, num_heads, num_kv_heads, head_dim, rope),
                                          FeedForward(embed_dim, intermediate_dim), RMSNorm(embed_dim, norm_eps),
                                          RMSNorm(embed_dim, norm_eps))
            for _ in range(num_layers))
        self.norm = RMSNorm(embed_dim, eps=norm_eps)
        self.output = TiedLinear(self.tok_embeddings) if tied else nn.Linear(embed_dim, vocab_size, bias=False)

    def hidden(self, tokens, input_pos=None):
        """The decoder's output before its head (``TransformerDecoder.forward`` up to ``self.norm``)."""
        if self.rope.cache is None:
            self.rope._build(tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, input_pos=input_pos)
        return self.norm(h)

    def forward(self, tokens, *, input_pos=None, chunks: int = 0):
        """``TransformerDecoder.forward``: the head's output per sequence chunk (``chunked_output``, a list, when
        the chunked loss set ``num_output_chunks``) or the whole logits upcast to fp32. A sharded (FSDP2) decoder
        runs through here: the root unit's all-gather is a hook on its forward."""
        h = self.hidden(tokens, input_pos=input_pos)
        if chunks:
            return [self.output(chunk) for chunk in h.chunk(chunks, dim=1)]
        return self.output(h).float()


def build(name: str) -> TransformerDecoder:
    return TransformerDecoder(**CONFIGS[name])


def batch(rows: int, seq_len: int, documents: int = 4, vocab: int = 30_000):
    """A packed batch as torchtune's ``PackedDataset`` makes it: tokens (below ``vocab``), labels and each token's
    position within its document (``input_pos``, restarting at each of ``documents`` equal documents a row)."""
    def make():
        tokens = torch.randint(0, vocab, (rows, seq_len))
        input_pos = torch.arange(seq_len).remainder(seq_len // documents).expand(rows, seq_len).contiguous()
        return {"input_ids": tokens, "labels": tokens.clone(), "input_pos": input_pos}
    return make
