"""Fuzz memfit's inputs: malformed and edge values for every public entry point.

A generator with a fixed seed makes cases for the API (``memfit.estimate``, ``memfit.plan``,
``memfit.apply``, ``Recipe(...)``, ``Recipe.load``, ``Recipe.save``) and the command line (every verb
and flag: sizes, numbers, recipe files, config.json files, ``package.module:function`` sources;
``estimate``, ``plan``, ``fit``, ``doctor``, ``serve-plan``). Each case passes when it
gives a normal result, or a ``MemfitError`` (CLI: exit status 2, or 1 for "nothing fits") whose
message is exactly one short line, with no traceback printed anywhere. Anything else is a
failure: another exception, a traceback on stderr, a long or multi-line message, a case over its
time limit (``CASE_SECONDS``; a plan whose arguments are unusual, ``PLAN_SECONDS``: an argument
that makes the search explode must be refused or bounded, not answered in minutes).

Models are tiny configs (two layers, width 32) so each case takes well under a second; a plan
reuses the traces of the few (target, batch, sequence) combinations it meets.

    python -m bench fuzz --cases 1000 --seed 0   # -> bench/results/fuzz.json (13-19 min on 2 busy cores)
    python -m bench fuzz --cases 200 --seed 3 --out /tmp/fuzz.json

``tests/test_fuzz.py`` runs a fast subset of the same generator.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
RESULTS = "fuzz.json"

import memfit  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.errors import MAX_MESSAGE, MemfitError  # noqa: E402
from bench import _results  # noqa: E402

CASE_SECONDS = 180  # a case over this is a failure (a plan's first traces take ~20 s on a busy CPU)
# A plan with an unusual argument (HARD_PLAN) over this is a failure: a huge, divisor-rich global batch,
# a huge sequence, a budget of a byte or of 10**30, a million GPUs must be refused or bounded. A valid
# plan's first traces of a new (target, batch, sequence) take ~20 s on 2 busy cores: the bound is twice that.
PLAN_SECONDS = 45
HUGE = "9" * 400  # past float's range as a number of bytes, and int()'s digit limit is 4300

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
             max_position_embeddings=64)
GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=32, n_layer=2, n_head=2, vocab_size=128,
            n_positions=64, bos_token_id=0, eos_token_id=0)
BERT = dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, vocab_size=128, max_position_embeddings=64)
TINY = {"llama": LLAMA, "gpt2": GPT2, "bert": BERT}

# A module of factories for ``package.module:function`` sources: good ones and every kind of bad one.
FACTORIES = '''
import torch
NOT_CALLABLE = 3
def tiny():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
def raises():
    raise RuntimeError("factory failed\\non two lines")
def returns_none():
    return None
def returns_int():
    return 7
def needs_args(width):
    return torch.nn.Linear(width, width)
def batch():
    return torch.randn(4, 8)
def batch_none():
    return None
def bad_batch():
    return torch.randn(4, 5)
def loss(model, batch):
    return model(batch).sum()
def loss_vector(model, batch):
    return model(batch)
def loss_raises(model, batch):
    raise KeyError("no loss here")
'''

INTS = ["0", "-1", "1", "2", "3", "4", "16", "007", "1e3", "1.5", "", " ", "nan", "inf", "abc", "0x10", "-0",
        "99999999999999999999", "2147483648", "1000000000", "\u0661\u0662", "12abc", "+4", "1_000", HUGE[:40],
        "9" * 5000]
SIZES = ["24GiB", "24GB", "80G", "512MiB", "1", "0", "-1GiB", "GiB", ".5G", "1.5TB", "1e400GiB", "nan", "inf",
         "24 gib", "1KiB", "100", "99999999999999999999999999999TB", "24XB", "1,000", "", "1GiB1", "0.0000001G",
         "10TiB", "3.5e3MiB", HUGE + "GiB", "99999999999999999999999999999999999999999GiB", HUGE]
WORDS = ["", " ", "x", "none", "None", "null", "-", "--", "\n", "a" * 5000, "\u00e9\u00e8", "\x00", "gpt2\n2",
         "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace")]
PRECISIONS = ["fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp8", "BF16-MIXED", ""]
OPTIMIZERS = ["adamw", "adam", "sgd", "adafactor", "adamw8bit", "paged_adamw8bit", "adamw4bit", "lion", "ADAMW", ""]
CHECKPOINTING = ["off", "blocks", "blocks:2", "blocks:0", "blocks:-1", "blocks:x", "blocks:99999999999999999999",
                 "selective", "modules:model.layers.0", "modules:,,", "modules:", "modules:nowhere", "on", "true",
                 "blocks:", ":", "modules: , "]
LORAS = ["off", "lora", "lora:8", "lora:0", "lora:00", "lora:-1", "lora:x", "qlora", "qlora:4", "lora:1e3",
         "lora:99999999999999999999", "lora:", "qlora:0", "LORA", "lora:8:8", "on"]
GPUS = ["rtx-4090", "t4", "v100", "a100", "h100-sxm", "rtx-9999", "", "NVIDIA A100-SXM4-80GB", "4090", "tpu"]
DEVICES = ["cpu", "cuda", "cuda:0", "tpu", "", "CPU", "mps"]
ALLOWS = ["", "lora", "qlora", "adamw8bit", "bf16", "lora,qlora", "lion", ",,", "LORA", "lora, bf16", "all"]
SOURCES = ["fuzzfactories:tiny", "fuzzfactories:NOT_CALLABLE", "fuzzfactories:raises", "fuzzfactories:returns_none",
           "fuzzfactories:returns_int", "fuzzfactories:needs_args", "fuzzfactories:missing", "nowhere.at_all:build",
           "fuzzfactories:", ":tiny", "fuzzfactories:tiny:x", "memfit.models.zoo:MLP", "os.path:sep", ":"]
ODD_VALUES = [None, True, False, 0, -1, 1, 2, 1.5, float("nan"), float("inf"), 10**30, -(10**30), "", "x", "2",
              [], [1], {}, {"a": 1}, b"bytes", object(), 2**63]

RECIPE_VALUES = {
    "precision": PRECISIONS, "checkpointing": CHECKPOINTING, "attention": ["auto", "sdpa", "eager", "flash", ""],
    "chunked_loss": [0, 1, 2, 4, -1, 10**9], "optimizer": OPTIMIZERS,
    "offload_activations": [True, False, "off", "yes"], "optimizer_in_backward": [True, False, 0, 1],
    "offload_optimizer": [True, False], "micro_batch_size": [None, 1, 2, 0, -1, 10**12],
    "grad_accum_steps": [1, 2, 0, -3, 10**9], "lora": LORAS,
}
FLAG_VALUES = {
    "--precision": PRECISIONS, "--checkpointing": CHECKPOINTING, "--attention": ["auto", "sdpa", "eager", "x"],
    "--chunked-loss": INTS, "--optimizer": OPTIMIZERS, "--micro-batch-size": INTS, "--grad-accum-steps": INTS,
    "--lora": LORAS, "--batch-size": INTS, "--seq-len": INTS, "--steps": INTS, "--budget": SIZES, "--gpu": GPUS,
    "--device": DEVICES, "--batch": SOURCES + ["fuzzfactories:batch", "fuzzfactories:batch_none",
                                               "fuzzfactories:bad_batch"],
    "--loss": SOURCES + ["fuzzfactories:loss", "fuzzfactories:loss_vector", "fuzzfactories:loss_raises"],
}
SWITCHES = ["--offload-activations", "--optimizer-in-backward", "--offload-optimizer", "--full", "--json"]
PLAN_FLAGS = {"--gpu": GPUS, "--budget": SIZES, "--device": ["cpu", "cuda", "tpu"], "--seq-len": INTS,
              "--global-batch-size": INTS, "--allow": ALLOWS, "--optimizer": ["adamw", "lion", "", "ADAMW"]}


# -- the workspace: config.json files, recipe files and a factory module ---------------------------

class Workspace:
    def __init__(self, path: str):
        self.path = path
        with open(os.path.join(path, "fuzzfactories.py"), "w") as f:
            f.write(FACTORIES)
        if path not in sys.path:
            sys.path.insert(0, path)
        self.count = 0

    def file(self, name: str, data: bytes | str) -> str:
        self.count += 1
        folder = os.path.join(self.path, f"f{self.count}")
        os.makedirs(folder)
        target = os.path.join(folder, name)
        with open(target, "wb") as f:
            f.write(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
        return target

    def config(self, rng: random.Random, bad: bool = False) -> str:
        """A config.json: valid, or with one key made wrong, or not a config at all (``bad``: a
        size made wrong, never valid: a valid new config costs a plan new traces)."""
        base = dict(TINY[rng.choice(list(TINY))])
        kind = rng.random()
        if bad:
            key = rng.choice([k for k in base if k not in ("architectures", "model_type")])
            base[key] = rng.choice([0, -1, 1.5, "x", [], {}, 10**30])
            return self.file("config.json", json.dumps(base))
        if kind < 0.55:
            key = rng.choice([k for k in base if k != "architectures"] + ["torch_dtype", "tie_word_embeddings",
                                                                            "rope_scaling", "head_dim"])
            base[key] = rng.choice([0, -1, -(10**9), 1.5, "x", None, [], {}, True, 10**12, 10**30, 3, "32"])
            text = json.dumps(base)
        elif kind < 0.7:
            base.pop(rng.choice(list(base)))
            text = json.dumps(base)
        elif kind < 0.8:
            text = rng.choice(["", "{", "[]", "3", "null", '{"model_type": "nonesuch"}', '{"model_type": 3}',
                               '{"model_type": "llama", "hidden_size": 1e999}', "\x00\x01\x02",
                               '{"model_type": "llama", "num_attention_heads": 3}',
                               '{"model_type": "gpt2", "n_embd": 33}'])
        else:
            text = json.dumps(base)
        return self.file("config.json", text)

    def recipe(self, rng: random.Random) -> str:
        """A recipe file: fields with random values, or one of the classic parser attacks."""
        kind = rng.random()
        ext = rng.choice([".yaml", ".yml", ".json", ".txt"])
        if kind < 0.45:
            fields = {k: rng.choice(v) for k, v in rng.sample(sorted(RECIPE_VALUES.items()), rng.randint(1, 4))}
            text = json.dumps(fields) if ext == ".json" else "\n".join(f"{k}: {_yaml(v)}" for k, v in fields.items())
            return self.file("r" + ext, text)
        attacks = [
            "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
                f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
            "[" * 10000 + "]" * 10000, "{a: " * 5000 + "1" + "}" * 5000, "1: 2\n", "? [a, b]\n: c\n", "null: x\n",
            "precision: !!python/object/apply:os.system ['true']\n", "lora: lora:00\n", "checkpointing: modules:,,\n",
            "checkpointing: off\n", "lora: off\n", "offload_activations: off\n", "optimizer_in_backward: yes\n",
            "", "   \n", "- a\n- b\n", "just text", "precision: [fp32]\n", "precision: {a: 1}\n",
            "grad_accum_steps: 1e999\n", "micro_batch_size: 99999999999999999999999\n", "chunked_loss: 2.0\n",
            "precision: fp32\nprecision: bf16\n", "\xef\xbb\xbfprecision: fp32\n", "precision: 'bf16-mixed\n",
            "\t precision: fp32\n", "precision: fp32\n" * 200000, "lora: qlora\nprecision: fp32\n",
            "precision: &x bf16-mixed\noptimizer: *x\n", "lora: !!binary aGVsbG8=\n", "precision: !custom x\n",
        ]
        choice = rng.choice(attacks + [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", bytes(range(256)),
                                       "precision: fp32\n".encode("utf-16")])
        return self.file("r" + ext, choice)


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) and (not value or ":" in value) else str(value)


# -- cases ----------------------------------------------------------------------------------------------

def make_cases(seed: int, n: int, ws: Workspace) -> list[dict]:
    """``n`` cases from ``seed``: (kind, description, arguments). Deterministic for a seed."""
    rng = random.Random(seed)
    kinds = [("recipe", 12), ("recipe_load", 14), ("estimate", 18), ("plan", 8), ("cli_estimate", 26),
             ("cli_plan", 10), ("cli_misc", 4), ("subprocess", 1), ("apply", 6), ("recipe_save", 4), ("cli_other", 5)]
    names = [k for k, w in kinds for _ in range(w)]
    cases = []
    for i in range(n):
        kind = rng.choice(names)
        cases.append({"id": i, "kind": kind, **globals()["_" + kind](rng, ws)})
    return cases


def _recipe(rng, ws):
    fields = {k: rng.choice(v + ODD_VALUES[:6]) for k, v in rng.sample(sorted(RECIPE_VALUES.items()), rng.randint(1, 5))}
    if rng.random() < 0.15:
        fields[rng.choice(["checkpoint", "", "1", "precision "])] = "x"
    return {"fields": fields, "run": rng.random() < 0.25}


def _recipe_load(rng, ws):
    path = ws.recipe(rng) if rng.random() < 0.9 else rng.choice([ws.path, os.path.join(ws.path, "missing.yaml"), ""])
    return {"path": path, "run": rng.random() < 0.3}


def _model(rng, ws):
    r = rng.random()
    if r < 0.5:
        return ws.config(rng)
    if r < 0.7:
        import transformers

        base = dict(TINY[rng.choice(list(TINY))])
        return ("config", base)
    if r < 0.85:
        return rng.choice(SOURCES)
    return rng.choice(["gpt2", "lama-3-8b", "", 42, None, "memfit.models.zoo:MLP", ws.path])


def _estimate(rng, ws):
    kwargs = {}
    pool = {"precision": PRECISIONS, "optimizer": OPTIMIZERS + ["factory:none", "factory:int"],
            "steps": [1, 2, 0, -1, 1.5, "2", 10**9, None, True, 2.0, 10**30],
            "batch_size": [1, 2, 3, 0, -2, None, 2.0, 10**9, 10**15, True, "2", 1.5],
            "seq_len": [8, 16, 0, None, 10**7, 10**12, "8", True, 1.5, -1],
            "device": DEVICES, "gpu": GPUS + [None], "fast": [True, False, None, "yes"],
            "budget": ["1GiB", 1, 10**30, HUGE + "GiB", "nan", -1, None],
            "recipe": ["fields", None, "not a recipe", {"precision": "fp32"}]}
    for name, values in rng.sample(sorted(pool.items()), rng.randint(0, 4)):
        kwargs[name] = rng.choice(values)
    if kwargs.get("recipe") == "fields":
        kwargs["recipe"] = {k: rng.choice(v) for k, v in rng.sample(sorted(RECIPE_VALUES.items()), rng.randint(1, 3))}
    kwargs.setdefault("seq_len", 16)
    if "budget" in kwargs:
        kwargs.setdefault("device", "cuda")
    return {"model": _model(rng, ws), "kwargs": kwargs}


# A plan's first traces of a (target, batch, sequence) take seconds; valid plans stay within these.
# With the CLI's two (1GiB on the default h100-sxm, t4) that is four engines, what plan caches.
PLAN_TARGETS = [{"budget": "1GiB"}, {"budget": "256MiB", "device": "cpu"}]


def _plan(rng, ws):
    if rng.random() < 0.2:  # one argument that could make the search explode, alone (PLAN_SECONDS)
        name, values = rng.choice(sorted(HARD_PLAN.items()))
        kwargs = {**PLAN_TARGETS[0], "global_batch_size": 2, "seq_len": 16, **rng.choice(values)}
        return {"model": ("config", LLAMA), "kwargs": kwargs, "seconds": PLAN_SECONDS}
    kwargs = dict(rng.choice(PLAN_TARGETS))
    kwargs.update(global_batch_size=2, seq_len=16)
    pool = {"budget": SIZES + [0, -5, 10**30, 1.5, None], "gpu": GPUS + [None], "device": DEVICES + [None],
            "global_batch_size": [2, 0, -1, None, 2.5, 10**9, 10**18, 7919 * 7907], "seq_len": [16, 0, -3, 10**12],
            "allow": ["", "lora", "bf16", "lion", ",,", ["lora"], [1], None],
            "optimizer": ["adamw", "lion", "", "ADAMW", [1], None]}  # a new optimizer is a new set of traces
    for name, values in rng.sample(sorted(pool.items()), rng.randint(0, 2)):
        kwargs[name] = rng.choice(values)
    model = ("config", LLAMA) if rng.random() < 0.8 else _bad_model(rng, ws)
    return {"model": model, "kwargs": kwargs}


# Arguments of plan that are valid on their face but unusual: each must be answered, refused or
# bounded within PLAN_SECONDS (a divisor-rich batch has hundreds of micro-batch sizes).
HARD_PLAN = {
    "global_batch_size": [{"global_batch_size": 8648640}, {"global_batch_size": 720720},
                          {"global_batch_size": 1 << 24}, {"global_batch_size": 5040}],
    "seq_len": [{"seq_len": 1 << 24}, {"seq_len": 1 << 20}],
    "budget": [{"budget": 1}, {"budget": "1"}, {"budget": 10**30}, {"budget": HUGE + "GiB"}, {"budget": "1KiB"}],
    "gpus": [{"gpus": 10**6, "gpu": "h100-sxm"}, {"gpus": 1 << 17, "gpu": "h100-sxm", "global_batch_size": 1 << 17},
             {"gpus": 8, "nodes": 1 << 14, "gpu": "h100-sxm", "global_batch_size": 1 << 17},
             {"gpus": True, "gpu": "h100-sxm"}, {"gpus": 0, "gpu": "h100-sxm"}, {"nodes": 2, "gpu": "h100-sxm"}],
}


def _bad_model(rng, ws):
    return ws.config(rng, bad=True) if rng.random() < 0.5 else rng.choice(
        SOURCES + ["lama-3-8b", "", "-", ws.path, 42, None])


def _cli_model(rng, ws):
    r = rng.random()
    if r < 0.55:
        return ws.config(rng)
    if r < 0.8:
        return ws.file("config.json", json.dumps(TINY[rng.choice(list(TINY))]))
    return rng.choice(SOURCES + ["gpt2", "lama-3-8b", "", "-", ws.path, "--json"])


def _cli_estimate(rng, ws):
    argv = ["estimate", _cli_model(rng, ws), "--seq-len", rng.choice(["8", "16"])]
    for flag in rng.sample(sorted(FLAG_VALUES), rng.randint(0, 4)):
        argv += [flag, rng.choice(FLAG_VALUES[flag])]
    argv += rng.sample(SWITCHES, rng.randint(0, 2))
    if rng.random() < 0.3:
        argv += ["--recipe", ws.recipe(rng)]
    if rng.random() < 0.05:
        argv.insert(rng.randrange(len(argv) + 1), rng.choice(WORDS + ["--nope", "-x"]))
    return {"argv": argv}


def _cli_plan(rng, ws):
    if rng.random() < 0.2:  # one argument that could make the search explode, alone: refused or bounded
        argv = ["plan", ws.file("config.json", json.dumps(LLAMA)), "--seq-len", "16", "--global-batch-size", "2",
                "--budget", "1GiB"] + rng.choice(HARD_CLI_PLAN)  # a flag given twice: the last counts
        return {"argv": argv, "seconds": PLAN_SECONDS}
    valid = rng.random() < 0.5
    model = ws.file("config.json", json.dumps(LLAMA)) if valid else str(_bad_model(rng, ws))
    argv = ["plan", model, "--seq-len", "16", "--global-batch-size", "2"]
    target = rng.choice([["--budget", "1GiB"], ["--gpu", "t4"]])
    argv += target
    for flag in rng.sample(sorted(PLAN_FLAGS), rng.randint(0, 2)):
        argv += [flag, rng.choice(PLAN_FLAGS[flag])]
    if rng.random() < 0.3:
        argv += ["--out", rng.choice([os.path.join(ws.path, "missing", "r.yaml"), os.path.join(ws.path, "o.yaml"),
                                      os.path.join(ws.path, "o.json"), os.path.join(ws.path, "o.txt"), ws.path, ""])]
    argv += rng.sample(["--json"], rng.randint(0, 1))
    return {"argv": argv}


HARD_CLI_PLAN = [["--global-batch-size", "8648640"], ["--global-batch-size", "720720"], ["--seq-len", "16777216"],
                 ["--budget", "1"], ["--budget", HUGE + "GiB"], ["--gpus", "1000000", "--gpu", "h100-sxm"],
                 ["--gpus", "131072", "--gpu", "h100-sxm", "--global-batch-size", "131072"],
                 ["--global-batch-size", HUGE], ["--seq-len", HUGE[:30]]]


# -- apply, Recipe.save and the other verbs -------------------------------------------------------------

class _NoParams(__import__("torch").nn.Module):
    def forward(self, x):
        return x


def _tiny_module():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _sum_loss(model, batch):
    return model(batch).sum()


# ``apply``'s arguments by name (a case holds names: JSON-printable, the same for a seed); each a
# zero-argument maker. The user's own callables here never raise: what they raise is theirs.
APPLY_MODELS = {"tiny": _tiny_module, "none": lambda: None, "name": lambda: "gpt2", "int": lambda: 3,
                "no parameters": _NoParams, "class": lambda: _NoParams,
                "config": lambda: _materialise(("config", GPT2))}
APPLY_RECIPES = {
    "none": lambda: None, "default": lambda: memfit.Recipe(), "bf16": lambda: memfit.Recipe(precision="bf16"),
    "accumulation": lambda: memfit.Recipe(grad_accum_steps=2), "in backward": lambda: memfit.Recipe(
        optimizer_in_backward=True), "sgd": lambda: memfit.Recipe(optimizer="sgd"), "str": lambda: "bf16-mixed",
    "dict": lambda: {"precision": "bf16"}, "int": lambda: 3, "list": lambda: ["bf16"], "zero": lambda: 0,
}
APPLY_OPTIMIZERS = {
    "default": lambda: None, "sgd": lambda: "sgd", "unknown": lambda: "nope", "int": lambda: 3, "list": lambda: [1],
    "factory": lambda: (lambda params: __import__("torch").optim.SGD(params, lr=0.1)),
    "factory:none": lambda: (lambda params: None), "factory:int": lambda: (lambda params: 7),
    "factory:object": lambda: (lambda params: object()), "factory:list": lambda: (lambda params: list(params)),
}
APPLY_LOSSES = {"sum": lambda: _sum_loss, "default": lambda: None, "int": lambda: 3, "str": lambda: "mse"}


def _factory(name: str):
    """``factory:none`` and the like: an optimizer factory returning something that is no optimizer."""
    return APPLY_OPTIMIZERS[name]() if isinstance(name, str) and name.startswith("factory:") else name


def _apply(rng, ws):
    return {"model": rng.choice(sorted(APPLY_MODELS)), "recipe": rng.choice(sorted(APPLY_RECIPES)),
            "optimizer": rng.choice(sorted(APPLY_OPTIMIZERS)), "loss_fn": rng.choice(sorted(APPLY_LOSSES)),
            "step": rng.random() < 0.7}


# Where ``Recipe.save`` is asked to write: (what, a maker of the path in the workspace).
SAVE_PATHS = {
    "yaml": lambda ws: os.path.join(ws.path, "saved.yaml"), "json": lambda ws: os.path.join(ws.path, "saved.json"),
    "txt": lambda ws: os.path.join(ws.path, "saved.txt"), "bytes": lambda ws: os.fsencode(os.path.join(ws.path,
                                                                                                       "b.yaml")),
    "pathlib": lambda ws: __import__("pathlib").Path(ws.path) / "p.yaml", "directory": lambda ws: ws.path,
    "missing folder": lambda ws: os.path.join(ws.path, "missing", "r.yaml"),
    "file as folder": lambda ws: os.path.join(ws.path, "fuzzfactories.py", "r.yaml"),
    "unwritable": lambda ws: "/dev/full" if os.path.exists("/dev/full") else os.path.join(ws.path, "missing", "x"),
    "read-only folder": lambda ws: os.path.join(_read_only(ws), "r.yaml"),
    "empty": lambda ws: "", "blank": lambda ws: "  ", "none": lambda ws: None, "int": lambda ws: 3,
    "nul": lambda ws: os.path.join(ws.path, "a\x00b.yaml"), "long name": lambda ws: os.path.join(ws.path, "x" * 300),
}


def _read_only(ws) -> str:
    folder = os.path.join(ws.path, "read-only")
    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, 0o500)  # as root still writable: then the save succeeds and loads back
    return folder


def _recipe_save(rng, ws):
    fields = rng.choice([{}, {"precision": "bf16-mixed"}, {"checkpointing": "blocks", "grad_accum_steps": 2},
                         {"lora": "lora:8"}])
    return {"fields": fields, "path": rng.choice(sorted(SAVE_PATHS))}


OOM_MESSAGE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
               "23.64 GiB of which 1.06 GiB is free. Of the allocated memory 20.12 GiB is allocated by PyTorch, and "
               "1.20 GiB is reserved by PyTorch but unallocated.")


def _cli_other(rng, ws):
    """fit, doctor and serve-plan with malformed values (the fast ones: no model for doctor)."""
    verb = rng.choice(["fit", "doctor", "doctor", "serve-plan"])
    model = ws.file("config.json", json.dumps(GPT2))
    if verb == "fit":
        argv = ["fit", model, "--seq-len", "8", "--budget", rng.choice(SIZES)]
        flags = {"--seq-len": INTS, "--device": ["cpu", "cuda", "x"], "--gpu": GPUS, "--gpus": INTS,
                 "--grad-accum-steps": INTS}
    elif verb == "doctor":
        argv = ["doctor", "--error", rng.choice([OOM_MESSAGE, "", "no oom here", ws.path,
                                                 os.path.join(ws.path, "missing.log"), "\x00", HUGE])]
        flags = {"--budget": SIZES, "--gpu": GPUS, "--allow": ALLOWS, "--batch-size": INTS, "--seq-len": INTS}
        argv.append("--no-plan")
    else:
        argv = ["serve-plan", model, "--context", rng.choice(INTS)]
        flags = {"--gpu": GPUS, "--gpus": INTS, "--chunk": INTS, "--block-size": INTS, "--budget": SIZES,
                 "--gpu-memory-utilization": ["0.9", "0", "1", "2", "nan", "inf", "-1", "x", HUGE],
                 "--max-num-batched-tokens": INTS, "--allow": ["", "int8", "nf4", "x", ",,"]}
    for flag in rng.sample(sorted(flags), rng.randint(0, 2)):
        argv += [flag, rng.choice(flags[flag])]
    argv += rng.sample(["--json"], rng.randint(0, 1))
    return {"argv": argv}


def _cli_misc(rng, ws):
    return {"argv": rng.choice([["models"], ["gpus"], ["models", "--json"], ["gpus", "--json"], [], ["nope"],
                                ["gpus", "x"], ["estimate"], ["plan"], ["--json"], ["models", "--jsn"]])}


def _subprocess(rng, ws):
    return {"argv": rng.choice([["estimate", ws.config(rng), "--seq-len", "8"], ["estimate", "gpt2", "--lora", "lora:00"],
                                ["estimate", "fuzzfactories:raises"], ["estimate", "fuzzfactories:returns_none"],
                                ["estimate", ws.file("config.json", json.dumps(LLAMA)), "--recipe", ws.recipe(rng)],
                                ["plan", "gpt2", "--global-batch-size", "1000000000", "--budget", "1GiB"],
                                ["estimate", "gpt2", "--gpu", "t4", "--precision", "bf16-mixed"]])}


# -- running and judging a case ----------------------------------------------------------------------

class _LoggedTracebacks(logging.Handler):
    """Records with a traceback sent to torch's loggers: torch writes them to the stderr it saw at
    import, past ``redirect_stderr``, so they are caught here."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        if record.exc_info:
            self.records.append(record.getMessage())


TORCH_LOG = _LoggedTracebacks()
TORCH_LOGGERS = ("torch", "torch._subclasses.fake_tensor")  # the second does not propagate


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _materialise(model):
    if isinstance(model, tuple) and model[0] == "config":
        import transformers

        data = dict(model[1])
        return transformers.AutoConfig.for_model(data.pop("model_type"), **{k: v for k, v in data.items()
                                                                             if k != "architectures"})
    return model


def _short_line(text: str) -> str | None:
    """None when ``text`` is one non-empty short line, else what is wrong with it."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        return f"{len(lines)} lines"
    if len(lines[0]) > MAX_MESSAGE + 40:
        return f"a line of {len(lines[0])} characters"
    return None


OUTCOMES: dict[str, int] = {}  # how the passing cases ended: a result, an error line, an exit status


def _outcome(name: str) -> None:
    OUTCOMES[name] = OUTCOMES.get(name, 0) + 1


def _api(call) -> str | None:
    """Run ``call``; None when it passed, else why it failed."""
    err_text = io.StringIO()
    try:
        with contextlib.redirect_stderr(err_text), contextlib.redirect_stdout(io.StringIO()):
            call()
        _outcome("api result")
    except MemfitError as err:
        _outcome("api MemfitError")
        problem = _short_line(str(err))
        if problem:
            return f"MemfitError message is {problem}: {str(err)[:300]!r}"
    except _Timeout:
        raise
    except BaseException as err:  # noqa: BLE001 — anything else is the bug being looked for
        return f"{type(err).__name__}: {str(err)[:300]!r} at {_where(err)}"
    if "Traceback" in err_text.getvalue():
        return f"traceback on stderr: {err_text.getvalue()[-300:]!r}"
    return None


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[::-1][:4])


def _cli(argv) -> str | None:
    out, err_text = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err_text), contextlib.redirect_stdout(out):
            try:
                status = main(list(argv))
            except SystemExit as exit_:
                status = exit_.code
    except _Timeout:
        raise
    except BaseException as err:  # noqa: BLE001
        return f"{type(err).__name__} escaped main: {str(err)[:300]!r} at {_where(err)}"
    return _judge_cli(status, err_text.getvalue(), argv)


def _judge_cli(status, stderr: str, argv) -> str | None:
    _outcome(f"cli exit {status}")
    if "Traceback" in stderr:
        return f"traceback on stderr: {stderr[-300:]!r}"
    if status == 0:
        return None
    if status == 1 and argv and argv[0] in ("plan", "fit") and "--json" in argv and not stderr.strip():
        return None  # nothing fits: the message is in the JSON
    if status in (3, 4) and argv and argv[0] == "doctor":
        return None  # diagnosed without a fix that fits (3), no out-of-memory error in the input (4)
    if status == 2 or (status == 1 and argv and argv[0] in ("plan", "fit")):
        problem = _short_line(stderr)
        return f"status {status} with {problem} on stderr: {stderr[:300]!r}" if problem else None
    return f"exit status {status!r}: {stderr[-300:]!r}"


def run_case(case: dict, ws: Workspace) -> str | None:
    kind = case["kind"]
    if kind == "recipe":
        def call():
            recipe = memfit.Recipe.from_dict(case["fields"])
            if case["run"]:
                memfit.estimate(_materialise(("config", LLAMA)), seq_len=8, recipe=recipe)
        return _api(call)
    if kind == "recipe_load":
        def call():
            recipe = memfit.Recipe.load(case["path"])
            if case["run"]:
                memfit.estimate(_materialise(("config", GPT2)), seq_len=8, recipe=recipe)
        return _api(call)
    if kind == "estimate":
        kwargs = dict(case["kwargs"])
        if isinstance(kwargs.get("recipe"), dict):
            def call():
                memfit.estimate(_materialise(case["model"]), **{**kwargs, "recipe": memfit.Recipe.from_dict(
                    kwargs["recipe"])})
            return _api(call)
        if "optimizer" in kwargs:
            kwargs["optimizer"] = _factory(kwargs["optimizer"])
        return _api(lambda: memfit.estimate(_materialise(case["model"]), **kwargs))
    if kind == "plan":
        return _api(lambda: memfit.plan(_materialise(case["model"]), **case["kwargs"]))
    if kind == "apply":
        return _api(lambda: _run_apply(case))
    if kind == "recipe_save":
        return _api(lambda: _run_save(case, ws))
    if kind == "subprocess":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ws.path]))
        proc = subprocess.run([sys.executable, "-m", "memfit.cli", *case["argv"]], capture_output=True, text=True,
                              env=env, timeout=CASE_SECONDS, errors="replace")
        return _judge_cli(proc.returncode, proc.stderr, case["argv"])
    return _cli(case["argv"])


def _run_apply(case: dict) -> None:
    import torch

    model, opt, step = memfit.apply(APPLY_MODELS[case["model"]](), APPLY_RECIPES[case["recipe"]](),
                                    optimizer=APPLY_OPTIMIZERS[case["optimizer"]](),
                                    loss_fn=APPLY_LOSSES[case["loss_fn"]]())
    if case["step"]:
        step(torch.randn(4, 8))


def _run_save(case: dict, ws: Workspace) -> None:
    recipe = memfit.Recipe(**case["fields"])
    path = SAVE_PATHS[case["path"]](ws)
    recipe.save(path)
    if path != "/dev/full" and memfit.Recipe.load(path) != recipe:  # a save that succeeds loads back equal
        raise AssertionError(f"Recipe.save then load changed {recipe!r}")


def _printable(case: dict) -> dict:
    """The case as JSON data, long strings cut (a recipe file's path stands for its content)."""
    def cut(value):
        return value[:200] + "..." if isinstance(value, str) and len(value) > 200 else value
    return json.loads(json.dumps(case, default=repr), object_hook=lambda d: {k: cut(v) for k, v in d.items()})


def fuzz(seed: int, cases: int, *, kinds: set[str] | None = None, only: set[int] | None = None, log=None) -> dict:
    """Run ``cases`` cases from ``seed``; returns counts and the failures."""
    counts: dict[str, dict[str, int]] = {}
    failures = []
    OUTCOMES.clear()
    old = signal.signal(signal.SIGALRM, _alarm)
    for name in TORCH_LOGGERS:
        logging.getLogger(name).addHandler(TORCH_LOG)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="memfit-fuzz-") as path:
            ws = Workspace(path)
            for case in make_cases(seed, cases, ws):
                if (kinds and case["kind"] not in kinds) or (only and case["id"] not in only):
                    continue
                t0 = time.perf_counter()
                seconds = case.get("seconds", CASE_SECONDS)
                signal.alarm(seconds)
                TORCH_LOG.records.clear()
                try:
                    problem = run_case(case, ws)
                    if not problem and TORCH_LOG.records:
                        problem = f"torch logged a traceback: {TORCH_LOG.records[0][:200]!r}"
                except _Timeout:
                    problem = f"over {seconds} s"
                except subprocess.TimeoutExpired:
                    problem = f"subprocess over {CASE_SECONDS} s"
                finally:
                    signal.alarm(0)
                tally = counts.setdefault(case["kind"], {"cases": 0, "failures": 0})
                tally["cases"] += 1
                if problem:
                    tally["failures"] += 1
                    failures.append({"case": _printable(case), "problem": problem})
                if log:
                    log(f"{case['id']:5d} {case['kind']:13s} {time.perf_counter() - t0:6.2f}s "
                        f"{'FAIL ' + problem[:160] if problem else 'ok'}")
    finally:
        signal.signal(signal.SIGALRM, old)
        for name in TORCH_LOGGERS:
            logging.getLogger(name).removeHandler(TORCH_LOG)
    total = sum(c["cases"] for c in counts.values())
    return {"seed": seed, "cases": total, "failures": len(failures), "by_kind": counts,
            "outcomes": dict(sorted(OUTCOMES.items())),
            "seconds": round(time.perf_counter() - start, 1), "max_message": MAX_MESSAGE, "failed": failures}


def _main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--kinds", default="", help="comma-separated case kinds to run (default all)")
    parser.add_argument("--out", default=RESULTS, help="a bare name: in bench/results/")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--show", type=int, nargs="*", help="print these cases of the seed and exit")
    parser.add_argument("--only", type=int, nargs="*", help="run only these cases of the seed")
    args = parser.parse_args()
    if args.show is not None:
        with tempfile.TemporaryDirectory(prefix="memfit-fuzz-") as path:
            for case in make_cases(args.seed, args.cases, Workspace(path)):
                if case["id"] in args.show:
                    print(json.dumps(_printable(case), default=repr))
        return 0
    kinds = {k for k in args.kinds.split(",") if k} or None
    seen = [0]

    def log(line: str) -> None:  # every case with -v; else each failure as found, and a count every 50 cases
        seen[0] += 1
        if args.verbose or " FAIL " in line:
            print(line, flush=True)
        elif seen[0] % 50 == 0:
            print(f"{seen[0]} of {args.cases} cases", file=sys.stderr, flush=True)

    result = fuzz(args.seed, args.cases, kinds=kinds, only=set(args.only or ()), log=log)
    totals = {k: v for k, v in result.items() if k not in ("failed", "seed")}
    _results.write(args.out, result["failed"], totals, seed=args.seed)
    print(json.dumps({k: v for k, v in result.items() if k != "failed"}, indent=1))
    for failure in result["failed"][:40]:
        print(failure["problem"][:200], "<-", json.dumps(failure["case"])[:300])
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(_main())
