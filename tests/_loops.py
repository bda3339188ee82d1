"""Users' own training loops, written as users write them (no memfit inside), for the profiler's tests
and bench/accuracy/profile_loops.py. Each is a generator that builds its model, optimizer and data, and yields after
every optimizer step, so the truth can read the CPU allocator's events one step at a time.

LEAKY: four loops that leak (the line that allocates what is kept is marked ``# leak``); CLEAN: three
that do not; MODELS: loops over six model families for the peak's accuracy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _llama(layers=2, hidden=128, vocab=512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2))


def _tokens(rows, length, vocab=512):
    return torch.randint(0, vocab, (rows, length))


# -- loops over model families ---------------------------------------------------------------------
def llama_adamw(steps=4):
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids = _tokens(4, 64)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield


def llama_bf16_autocast(steps=4):
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for _ in range(steps):
        ids = _tokens(2, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def gpt2_accumulate_clip(steps=4):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=96, n_layer=2, n_head=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        for _micro in range(2):
            ids = _tokens(2, 48)
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        yield


def bert_mlm_sgd(steps=4):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=512, hidden_size=96, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=192, max_position_embeddings=128))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        ids = _tokens(4, 40)
        mask = torch.ones_like(ids)
        mask[:, 30:] = 0
        labels = ids.masked_fill(torch.rand(ids.shape) > 0.15, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def convnet_adam(steps=4):
    torch.manual_seed(0)
    model = _ConvNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield


class _Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(200, 64)
        self.lstm = torch.nn.LSTM(64, 96, num_layers=2, batch_first=True)
        self.out = torch.nn.Linear(96, 12)

    def forward(self, ids):
        return self.out(self.lstm(self.embed(ids))[0])


def lstm_rmsprop(steps=4):
    torch.manual_seed(0)
    model = _Tagger()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids, tags = torch.randint(0, 200, (6, 30)), torch.randint(0, 12, (6, 30))
        loss = F.cross_entropy(model(ids).flatten(0, 1), tags.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield


def t5_adafactor(steps=4):
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                num_heads=4, decoder_start_token_id=0))
    opt = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    for _ in range(steps):
        src, tgt = _tokens(4, 32), _tokens(4, 16)
        loss = model(input_ids=src, labels=tgt).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield


MODELS = {"llama-adamw": llama_adamw, "llama-bf16-autocast": llama_bf16_autocast,
          "gpt2-accumulate-clip": gpt2_accumulate_clip, "bert-mlm-sgd": bert_mlm_sgd,
          "convnet-adam": convnet_adam, "lstm-rmsprop": lstm_rmsprop, "t5-adafactor": t5_adafactor}


# -- leaks ----------------------------------------------------------------------------------------
def leak_retain_graph(steps=6):
    """backward(retain_graph=True) and the loss kept: every step's saved activations stay."""
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        ids = _tokens(2, 32)
        loss = model(input_ids=ids, labels=ids).loss  # leak
        loss.backward(retain_graph=True)
        losses.append(loss)
        opt.step()
        opt.zero_grad()
        yield


def leak_cache(steps=6):
    """A cache of hidden states that grows every step."""
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cache = []
    for _ in range(steps):
        ids = _tokens(2, 32)
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
        cache.append(out.hidden_states[-1].detach().clone())  # leak
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        yield


def leak_hook(steps=6):
    """A forward hook that keeps every output of the first MLP."""
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = []
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: kept.append(output))
    for _ in range(steps):
        ids = _tokens(2, 32)
        loss = model(input_ids=ids, labels=ids).loss  # leak
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield


def leak_eval_with_grad(steps=6):
    """Evaluation each step without torch.no_grad(), its loss kept with its graph."""
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    val_ids = _tokens(2, 32)
    val_losses = []
    for _ in range(steps):
        ids = _tokens(2, 32)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        val_losses.append(model(input_ids=val_ids, labels=val_ids).loss)  # leak
        model.train()
        yield


LEAKY = {"retain-graph": leak_retain_graph, "cache": leak_cache, "hook": leak_hook,
         "eval-with-grad": leak_eval_with_grad}


def clean_plain(steps=6):
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids = _tokens(2, 32)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        yield


def clean_logged(steps=6):
    """Losses logged as Python floats (``.item()``): nothing kept."""
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history = []
    for _ in range(steps):
        ids = _tokens(2, 32)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        history.append(loss.item())
        opt.step()
        opt.zero_grad()
        yield


def clean_accumulate_eval(steps=6):
    """Two micro-batches, gradients zeroed in place, evaluation under no_grad."""
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    val_ids = _tokens(2, 32)
    for _ in range(steps):
        for _micro in range(2):
            ids = _tokens(2, 32)
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        with torch.no_grad():
            model.eval()
            model(input_ids=val_ids, labels=val_ids)
            model.train()
        yield


CLEAN = {"plain": clean_plain, "logged": clean_logged, "accumulate-eval": clean_accumulate_eval}


def leak_line(loop) -> int:
    """The line of ``loop`` marked ``# leak``."""
    import inspect

    lines, start = inspect.getsourcelines(loop)
    return next(start + i for i, line in enumerate(lines) if line.rstrip().endswith("# leak"))
