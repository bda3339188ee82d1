"""LitGPT's LoRA GPT as the resource tables ran it ("LitGPT version: commit 8641822"), restated for
``bench/published/published.py``, which estimates LitGPT's own model rather than a Hugging Face stand-in.

From Lightning-AI/lit-gpt at 8641822 (Apache-2.0): ``lit_gpt/model.py``, ``lit_gpt/lora.py``,
``lit_gpt/rmsnorm.py`` and the three configs of ``lit_gpt/config.py`` the tables use, trimmed to the
training forward (no KV cache, merging or checkpoint loading; flash-attn is not in that commit's
requirements, so attention is SDPA). The ops are LitGPT's, in LitGPT's order, because which tensors
each op saves is the memory: one qkv linear whose LoRA output (q and v parts) is zero-padded to the
fused width with ``index_copy`` (which keeps its source for backward), v a view of that qkv output,
RoPE against an fp32 cache, LitGPT's RMSNorm without an fp32 upcast, one LoRA dropout for q and v.

Two pieces of the stack around it, also restated (``finetune/lora.py`` runs them):

- Lightning Fabric 2.1 (commit 71aed751, LitGPT's pin): ``bf16-true`` and ``BitsandbytesPrecision``
  cast the model's output to the default dtype (``convert_output``: fp32), so the logits LitGPT's
  loss sees are fp32; see ``published.litgpt_loss``. ``--quantize bnb.nf4-dq`` builds every
  ``nn.Linear`` (the head included) as bitsandbytes NF4 with double-quantised statistics
  (``_NF4DQLinear``), quantising ``weight.to(torch.half)``: the quantisation state's dtype is fp16.
- bitsandbytes 0.41.1 (the tables' version): ``Linear4bit.forward`` -> ``MatMul4Bit``, which
  dequantises the whole weight (fp16, then a bf16 copy) in forward and in backward, and keeps its
  input ``A`` for backward (``ctx.tensors = (A, B)``) though backward never reads it; bitsandbytes
  dropped it in 0.43.2 ("fix QLoRA mem bug: delete useless buffered activation", #1270).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.nn import functional as F

# lit_gpt/config.py at 8641822, the three models of the LoRA table (Config defaults folded in).
CONFIGS = {
    "phi-1_5": dict(padded_vocab_size=51200, block_size=2048, n_embd=2048, n_layer=24, n_head=32,
                    rotary_percentage=0.5, parallel_residual=True, shared_attention_norm=True, bias=True,
                    lm_head_bias=True, norm_class="LayerNorm", norm_eps=1e-5, mlp_class="GptNeoxMLP",
                    intermediate_size=4 * 2048, gelu_approximate="tanh"),
    "Llama-2-7b-hf": dict(padded_vocab_size=32000, block_size=4096, n_embd=4096, n_layer=32, n_head=32,
                          rotary_percentage=1.0, parallel_residual=False, shared_attention_norm=False, bias=False,
                          lm_head_bias=False, norm_class="RMSNorm", norm_eps=1e-5, mlp_class="LLaMAMLP",
                          intermediate_size=11008),
    "Llama-2-13b-hf": dict(padded_vocab_size=32000, block_size=4096, n_embd=5120, n_layer=40, n_head=40,
                           rotary_percentage=1.0, parallel_residual=False, shared_attention_norm=False, bias=False,
                           lm_head_bias=False, norm_class="RMSNorm", norm_eps=1e-5, mlp_class="LLaMAMLP",
                           intermediate_size=13824),
}


class Config:
    """The fields of ``lit_gpt.lora.Config`` the forward reads; finetune/lora.py's LoRA settings."""

    def __init__(self, name=None, *, r=8, alpha=16, dropout=0.05, to_query=True, to_key=False, to_value=True,
                 **fields):
        for key, value in dict(CONFIGS[name] if name else {}, **fields).items():
            setattr(self, key, value)
        self.r, self.alpha, self.dropout = r, alpha, dropout
        self.enable_lora = (to_query, to_key, to_value)
        self.n_query_groups = getattr(self, "n_query_groups", self.n_head)
        self.head_size = self.n_embd // self.n_head
        self.rope_n_elem = int(self.rotary_percentage * self.head_size)


class RMSNorm(nn.Module):  # lit_gpt/rmsnorm.py
    def __init__(self, size: int, dim: int = -1, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.dim = eps, dim

    def forward(self, x):
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return self.weight * x_normed


def _norm(config):
    cls = RMSNorm if config.norm_class == "RMSNorm" else nn.LayerNorm
    return cls(config.n_embd, eps=config.norm_eps)


class LoRALinear(nn.Module):  # lit_gpt/lora.py LoRALinear; r=0 everywhere but the qkv linear here
    def __init__(self, in_features, out_features, r=0, lora_alpha=1, lora_dropout=0.0, **kwargs):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, **kwargs)  # looked up now: Fabric swaps it
        self.r = r
        assert r == 0, "the table's runs adapt only the qkv linear"

    def forward(self, x):
        return self.linear(x)


class LoRAQKVLinear(nn.Module):  # lit_gpt/lora.py LoRAQKVLinear, enable_lora=(q, k, v)
    def __init__(self, in_features, out_features, n_head, n_query_groups, r, lora_alpha, lora_dropout, enable_lora,
                 **kwargs):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, **kwargs)
        self.n_head, self.n_query_groups, self.r = n_head, n_query_groups, r
        self.lora_dropout = nn.Dropout(p=lora_dropout) if lora_dropout > 0.0 else (lambda x: x)
        self.enable_lora = list(enable_lora)
        self.lora_A = nn.Parameter(torch.zeros((r * sum(enable_lora), in_features)))
        enable_q, enable_k, enable_v = enable_lora
        self.kv_embd_size = in_features // (n_head // n_query_groups)
        shapes = (in_features * enable_q, self.kv_embd_size * enable_k, self.kv_embd_size * enable_v)
        self.qkv_shapes = [s for s in shapes if s]
        self.lora_B = nn.Parameter(torch.zeros(sum(self.qkv_shapes), r))
        self.scaling = lora_alpha / r
        self.lora_ind = []
        if enable_q:
            self.lora_ind.extend(range(0, in_features))
        if enable_k:
            self.lora_ind.extend(range(in_features, in_features + self.kv_embd_size))
        if enable_v:
            self.lora_ind.extend(range(in_features + self.kv_embd_size, out_features))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def zero_pad(self, x):
        if all(self.enable_lora):
            return x
        x = x.transpose(0, 1)
        result = x.new_zeros((*x.shape[:-1], self.linear.out_features))
        result = result.view(-1, self.linear.out_features)
        result = result.index_copy(1, torch.tensor(self.lora_ind, device=result.device),
                                   x.reshape(-1, sum(self.qkv_shapes)))
        return result.view((*x.shape[:-1], self.linear.out_features)).transpose(0, 1)

    def conv1d(self, input, weight):
        if self.n_head == self.n_query_groups:
            return F.conv1d(input, weight, groups=sum(self.enable_lora))
        input_splitted = input.chunk(sum(self.enable_lora), dim=1)
        weight_splitted = weight.split(self.qkv_shapes)
        return torch.cat([F.conv1d(a, b) for a, b in zip(input_splitted, weight_splitted)], dim=1)

    def forward(self, x):
        pretrained = self.linear(x)
        after_A = F.linear(self.lora_dropout(x), self.lora_A)
        after_B = self.conv1d(after_A.transpose(-2, -1), self.lora_B.unsqueeze(-1)).transpose(-2, -1)
        lora = self.zero_pad(after_B) * self.scaling
        return pretrained + lora


def build_rope_cache(seq_len, n_elem, dtype, device=None, base=10000, condense_ratio=1):  # lit_gpt/model.py
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=device) / n_elem))
    seq_idx = torch.arange(seq_len, device=device) / condense_ratio
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    cos, sin = torch.cos(idx_theta), torch.sin(idx_theta)
    if dtype in (torch.float16, torch.bfloat16, torch.int8):
        return cos.half(), sin.half()
    return cos, sin


def apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.attn = LoRAQKVLinear(config.n_embd, shape, n_head=config.n_head, n_query_groups=config.n_query_groups,
                                  r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                  enable_lora=config.enable_lora, bias=config.bias)
        self.proj = LoRALinear(config.n_embd, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        qkv = self.attn(x)
        q_per_kv = self.config.n_head // self.config.n_query_groups
        total_qkv = q_per_kv + 2
        qkv = qkv.view(B, T, self.config.n_query_groups, total_qkv, self.config.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        if self.config.n_query_groups != 1:
            k = k.expand(B, self.config.n_query_groups, q_per_kv, T, self.config.head_size)
            v = v.expand(B, self.config.n_query_groups, q_per_kv, T, self.config.head_size)
        q = q.reshape(B, -1, T, self.config.head_size)
        k = k.reshape(B, -1, T, self.config.head_size)
        v = v.reshape(B, -1, T, self.config.head_size)
        n = self.config.rope_n_elem
        q_roped = apply_rope(q[..., :n], cos, sin)
        k_roped = apply_rope(k[..., :n], cos, sin)
        q = torch.cat((q_roped, q[..., n:]), dim=-1)
        k = torch.cat((k_roped, k[..., n:]), dim=-1)
        scale = 1.0 / math.sqrt(self.config.head_size)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class GptNeoxMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = LoRALinear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = LoRALinear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x):
        x = self.fc(x)
        x = torch.nn.functional.gelu(x, approximate=self.config.gelu_approximate)
        return self.proj(x)


class LLaMAMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_1 = LoRALinear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = LoRALinear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = LoRALinear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x):
        x_fc_1 = self.fc_1(x)
        x_fc_2 = self.fc_2(x)
        x = torch.nn.functional.silu(x_fc_1) * x_fc_2
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm_1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        if not config.shared_attention_norm:
            self.norm_2 = _norm(config)
        self.mlp = GptNeoxMLP(config) if config.mlp_class == "GptNeoxMLP" else LLaMAMLP(config)
        self.config = config

    def forward(self, x, cos, sin):
        n_1 = self.norm_1(x)
        h = self.attn(n_1, cos, sin)
        if self.config.parallel_residual:
            n_2 = n_1 if self.config.shared_attention_norm else self.norm_2(x)
            return x + h + self.mlp(n_2)
        x = x + h
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):  # lit_gpt/lora.py GPT
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.lm_head = LoRALinear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=_norm(config)))
        self.max_seq_length = config.block_size

    @property
    def max_seq_length(self):
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value):
        self._max_seq_length = value
        if not hasattr(self, "cos"):
            cos, sin = self.rope_cache()
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        elif value != self.cos.size(0):
            self.cos, self.sin = self.rope_cache(device=self.cos.device)

    def rope_cache(self, device=None):
        return build_rope_cache(self.max_seq_length, self.config.rope_n_elem, torch.get_default_dtype(), device)

    def forward(self, idx, lm_head_chunk_size: int = 0):
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        x = self.transformer.ln_f(x)
        if lm_head_chunk_size > 0:
            return [self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]
        return self.lm_head(x)


def mark_only_lora_as_trainable(model):
    for n, p in model.named_parameters():
        if "lora_" not in n:
            p.requires_grad = False


# --- bitsandbytes 0.41.1 as Fabric's bnb.nf4-dq builds it ---------------------------------------

class _MatMul4Bit041(torch.autograd.Function):
    """bitsandbytes 0.41.1 ``MatMul4Bit`` (autograd/_functions.py), its quant state's dtype fp16."""

    @staticmethod
    def forward(ctx, A, B, out=None, bias=None, state=None):
        from bitsandbytes import functional as bf

        output = torch.nn.functional.linear(A, bf.dequantize_4bit(B, state).to(A.dtype).t(), bias)
        ctx.state = state
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
        ctx.tensors = (A, B) if any(ctx.needs_input_grad[:2]) else (None, None)  # A kept, never read
        return output

    @staticmethod
    def backward(ctx, grad_output):
        from bitsandbytes import functional as bf

        req_gradA, _, _, req_gradBias, _ = ctx.needs_input_grad
        _, B = ctx.tensors  # A was kept, and is not read
        grad_A, grad_bias = None, None
        if req_gradBias:
            grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias)
        if req_gradA:
            grad_A = torch.matmul(grad_output, bf.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t())
        return grad_A, None, None, grad_bias, None


def nf4_dq_linear():
    """Fabric's ``_NF4DQLinear`` (a bitsandbytes ``Linear4bit``: NF4, compress_statistics, bf16 compute)
    with bitsandbytes 0.41.1's forward. memfit quantises its weight before the step
    (``memfit.techniques.lora.quantize_pending``)."""
    import bitsandbytes as bnb

    class _NF4DQLinear(bnb.nn.Linear4bit):
        def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
            super().__init__(in_features, out_features, bias=bias, compute_dtype=torch.bfloat16,
                             compress_statistics=True, quant_type="nf4", device=device)

        def forward(self, x):  # bitsandbytes 0.41.1 Linear4bit.forward
            if self.bias is not None and self.bias.dtype != x.dtype:
                self.bias.data = self.bias.data.to(x.dtype)
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            state = copy.copy(self.weight.quant_state)
            state.dtype = torch.float16  # Fabric quantised weight.to(torch.half): its dequantisation is fp16
            return _MatMul4Bit041.apply(x, self.weight.t(), None, bias, state).to(inp_dtype)

    return _NF4DQLinear


def build(name: str, quantize: str | None = None, **overrides) -> GPT:
    """finetune/lora.py's model: ``GPT(Config.from_name(name, r=8, alpha=16, dropout=0.05, to_query=True,
    to_value=True))`` with only the adapters trainable; ``quantize="bnb.nf4-dq"`` builds every
    ``nn.Linear`` as Fabric's NF4 layer (Fabric's init context swaps ``torch.nn.Linear``)."""
    config = Config(name, **overrides)
    if quantize is None:
        model = GPT(config)
    else:
        assert quantize == "bnb.nf4-dq", quantize
        original, torch.nn.Linear = torch.nn.Linear, nf4_dq_linear()
        try:
            model = GPT(config)
        finally:
            torch.nn.Linear = original
    mark_only_lora_as_trainable(model)
    return model
