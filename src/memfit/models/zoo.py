"""Small reference models of every family memfit is checked on, with their batches and losses.

Tests, benchmarks and the GPU runs all draw their cases from here, so a figure in the README and
an assertion in a test speak of the same model. Use one from the command line as
``memfit estimate memfit.models.zoo:GPT --batch memfit.models.zoo:gpt_batch --loss memfit.models.zoo:lm_loss``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F



class MLP(nn.Module):
    def __init__(self, d=256, hidden=1024, classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class LSTMNet(nn.Module):
    def __init__(self, d=64, hidden=128):
        super().__init__()
        self.lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class Encoder(nn.Module):
    def __init__(self, d=128, layers=2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=512, d=128, layers=2, heads=4, ctx=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def lm_loss(model, batch):
    logits = model(batch)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def gpt_batch(batch=4, seq=64, vocab=512):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def hf(kind):
    """A tiny Hugging Face model factory and its batch."""
    import transformers as tf

    if kind == "llama":
        cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
        return (lambda: tf.LlamaForCausalLM(cfg)), cfg
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=128)
        return (lambda: tf.GPT2LMHeadModel(cfg)), cfg
    cfg = tf.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                        vocab_size=512, max_position_embeddings=128)
    return (lambda: tf.BertForMaskedLM(cfg)), cfg


def token_batch(batch=4, seq=64, vocab=512):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


# name -> (factory, batch factory, loss_fn)
CASES = {
    "mlp": (MLP, lambda: (torch.randn(64, 256), torch.randint(0, 10, (64,))), classify),
    "cnn": (CNN, lambda: (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))), classify),
    "lstm": (LSTMNet, lambda: (torch.randn(8, 24, 64), torch.randint(0, 10, (8,))), classify),
    "encoder": (Encoder, lambda: (torch.randn(8, 32, 128), torch.randint(0, 10, (8,))), classify),
    "gpt": (GPT, lambda: gpt_batch(), lm_loss),
    "hf-llama": (hf("llama")[0], token_batch, None),
    "hf-gpt2": (hf("gpt2")[0], token_batch, None),
    "hf-bert": (hf("bert")[0], token_batch, None),
}
