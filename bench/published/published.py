"""memfit against GPU peak-memory figures that others measured and published.

    python -m bench published                    # every row; writes bench/results/published.json
    python -m bench published --rows tt-8b-full-4090,hf-bert-vanilla   # a few (merged into the file)
    python -m bench published --json             # the result as JSON on stdout
    python -m bench published --markdown         # the README table, from the results file (no estimates)
    python -m bench published --variants         # the undiagnosed rows under the other readings of their
                                                 # source (VARIANTS) -> results/published-variants.json
    python -m bench published --variants --rows tt-405b-qlora-8xa100   # one row's (merged into that file)

The rows (``bench/published/_rows.py``) quote torchtune's README tables, torchao's optimizer
benchmarks, the Hugging Face single-GPU training guide and LitGPT's resource tables: each names its
source, commit and row, the run's settings, and what was measured. memfit's figure of the same kind
is compared: ``active`` / ``allocated`` with ``peak_bytes``, ``reserved`` with ``reserved_bytes``,
``nvidia-smi`` with ``device_bytes`` (reserved + what the process holds outside the allocator,
``hardware/outside.py``; where the source measured its own context and ran with eager module loading,
``published_context_mib``, reserved + that context and cuBLAS: ``Workload(eager_loading=True,
context_bytes=...)``). This is the only
independent truth a CPU-only machine has for whole recipes at full size; the figures were taken by
other people on other software versions, so a row's error mixes memfit's error with version drift.

Features being built beside this bench are detected, not assumed: a Recipe field the tree does not
have (``compile``, ``lora_targets``, ``lora_alpha``, ``lora_dropout``, ``offload_gradients``), an
``estimate`` keyword it does not take (``packed``), a report without ``managed_bytes`` (paged
optimizer state counted inside the allocator), or a torchao optimizer it cannot trace: the row runs
without it and lists it under ``missing``. Rows are never dropped for a miss; the summary gives the
median over all rows and over the rows that miss nothing. A row this tree refuses to estimate at
all (``offload_optimizer`` cannot be traced with CUDA semantics) is listed as not estimated, with
the refusal, and left out of the medians. A row whose published figure lies below what its stated settings must
hold at one moment of the step (``_floors.py``: arithmetic on its decoder, each kind held against the allocator)
carries that floor; the summary names those rows and the worst of the others, and keeps them in the medians.

Written by hand (no library compares an estimator with published tables). The rows run the model that
ran: torchtune's decoder and LitGPT's GPT restated at the commits their tables name
(``_torchtune_1814feb.py``, ``_litgpt_8641822.py``), a Hugging Face model for the others. The two loss functions
below restate what torchtune's recipes and LitGPT's ``finetune/lora.py`` compute, because the
Hugging Face ``model(**batch).loss`` upcasts the whole logits to fp32 and they do not; for the 2022
Hugging Face rows, torch 1.10's softmax autograd (it saved its input) is restated the same way, and for
torchtune's 8-bit AdamW row the compiled torchao step as torch 2.5.1 and torchao 0.6.1 ran it (measured on
the CPU allocator under those versions: ``torchao_step.py``). A multi-GPU row (``gpus``) is one rank's step under
FSDP2 on PyTorch's fake process group, its ``batch_size`` each rank's; its loss takes the head's output from the
decoder's forward, where the root unit's all-gather hook runs.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import memfit  # noqa: E402
from memfit.techniques.recipe import Recipe  # noqa: E402
from memfit.techniques.registry import fields  # noqa: E402
from bench import _results  # noqa: E402
from bench.published import _floors as floors  # noqa: E402
from bench.published._rows import EXCLUDED, ROWS, TT_405B_QLORA  # noqa: E402

RESULTS = ("published.json", "published-variants.json")
UNITS = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20}
FIGURE = {"active": "peak_bytes", "allocated": "peak_bytes", "reserved": "reserved_bytes",
          "nvidia-smi": "device_bytes"}
IGNORE = -100


# --- the losses the sources compute ---------------------------------------------------------------

def _lm_parts(model):
    """(the decoder without its head, as batch -> hidden states; the head) of a Hugging Face causal LM or of
    torchtune's restated decoder (``_torchtune_1814feb.py``), through a peft wrapper."""
    from bench.published._torchtune_1814feb import TransformerDecoder

    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    if isinstance(model, TransformerDecoder):
        return (lambda batch: model.hidden(batch["input_ids"], input_pos=batch["input_pos"])), model.output
    return (lambda batch: model.base_model(input_ids=batch["input_ids"]).last_hidden_state), \
        model.get_output_embeddings()


def _chunk_ce(piece, y):
    """``CEWithChunkedOutputLoss.compute_cross_entropy``: one chunk upcast to fp32, summed CE."""
    return F.cross_entropy(piece.reshape(-1, piece.shape[-1]).float(), y.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def _plain_ce(logits, labels):
    """``nn.CrossEntropyLoss`` on the logits (fp32: the decoder upcast them)."""
    return F.cross_entropy(logits, labels, ignore_index=IGNORE)


def _same(tensor):
    return tensor


# Whether a torchtune recipe (at 1814feb17) keeps what ``training.compile_loss`` returns. compile_loss
# (torchtune/training/_compile.py) compiles the chunked loss in place (``loss.compute_cross_entropy =
# torch.compile(...)``) but returns ``torch.compile(loss)`` for any other loss, and
# recipes/full_finetune_single_device.py line 292 calls ``training.compile_loss(self._loss_fn)`` without
# assigning it: with ``compile=True`` its plain ``nn.CrossEntropyLoss`` runs eager (still so on torchtune's main).
# lora_finetune_single_device.py line 296 assigns it.
# The distributed recipes at 30b8519e8 (the 70B rows) drop it too (their lines 234 and 250); they run the chunked loss.
KEEPS_COMPILED_LOSS = {"full_finetune_single_device": False, "lora_finetune_single_device": True,
                       "full_finetune_distributed": False, "lora_finetune_distributed": False}


def torchtune_loss(chunks: int, compiled: bool = False, head_on_device: bool = False,
                   recipe: str = "lora_finetune_single_device", sharded: bool = False):
    """torchtune's recipe loss: labels shifted by one with an ignored last position. ``chunks`` 0:
    ``nn.CrossEntropyLoss`` on the logits, which ``TransformerDecoder.forward`` upcast to fp32
    (``self.output(h).float()``, torchtune/modules/transformer.py at 1814feb17; the recipe then drops
    them, ``del logits``, so only the cross-entropy's saved fp32 log-probabilities stay); else
    ``CEWithChunkedOutputLoss``: the
    decoder's output projection per sequence chunk (all chunks kept), each chunk upcast to fp32 in
    its own cross-entropy (torchtune/modules/loss/ce_chunked_output_loss.py). ``compiled``:
    ``training.compile_loss`` (with compile=layers): the chunk's upcast and cross-entropy compiled,
    or the whole ``nn.CrossEntropyLoss`` where ``recipe`` keeps it (``KEEPS_COMPILED_LOSS``). ``head_on_device`` (the recipe offloads activations): the
    output projection runs under identity saved-tensor hooks, torchtune's ``NoOpManager``, which
    ``get_act_offloading_ctx_manager`` registers around ``model.output`` so the head's saved tensors
    are not offloaded (torchtune/training/_activation_offloading.py, 1814feb17, lines 397-419). ``sharded``
    (FSDP2): the head's chunks come from the decoder's own forward, as torchtune's do (``chunked_output``), so
    that the root unit's all-gather (a forward hook) runs before the head."""
    chunk_ce, plain_ce = _chunk_ce, _plain_ce
    if compiled:
        from memfit.techniques.compile import compiled as compile_piece

        chunk_ce = compile_piece(_chunk_ce)
        if KEEPS_COMPILED_LOSS[recipe]:
            plain_ce = compile_piece(_plain_ce)

    def loss_fn(model, batch):
        if sharded:  # the head's chunks from the decoder's forward, where the root unit's all-gather hook runs
            labels = _shifted(batch["labels"])
            return _cross_entropy(model(batch["input_ids"], input_pos=batch["input_pos"], chunks=chunks), labels,
                                  chunk_ce, plain_ce)
        base, lm_head = _lm_parts(model)
        head = lm_head
        if head_on_device:
            def head(x):
                with torch.autograd.graph.saved_tensors_hooks(_same, _same):  # torchtune's NoOpManager
                    return lm_head(x)
        hidden = base(batch)
        labels = _shifted(batch["labels"])
        out = [head(h) for h in hidden.chunk(chunks, dim=1)] if chunks else head(hidden).float()
        return _cross_entropy(out, labels, chunk_ce, plain_ce)

    return loss_fn


def _shifted(labels):
    """Labels shifted by one, the last position ignored (torchtune's recipes)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1)


def _cross_entropy(out, labels, chunk_ce, plain_ce):
    """The loss of ``out``: fp32 logits (``nn.CrossEntropyLoss``) or the head's chunks (``CEWithChunkedOutputLoss``)."""
    if not isinstance(out, list):
        return plain_ce(out.reshape(-1, out.shape[-1]), labels.reshape(-1))
    total = out[0].new_zeros((), dtype=torch.float32)
    for piece, y in zip(out, labels.chunk(len(out), dim=1)):
        total = total + chunk_ce(piece, y)
    return total / (labels != IGNORE).sum()


def litgpt_loss(chunk_tokens: int):
    """LitGPT 8641822 ``finetune/lora.py`` on its own GPT (``_litgpt_8641822.py``) under Lightning Fabric:
    ``model.max_seq_length = longest`` (the RoPE cache rebuilt in the default dtype, fp32),
    ``model(x, lm_head_chunk_size=128)`` gives the head's output per 128-token chunk, Fabric's
    ``convert_output`` casts each to the default dtype (fp32: ``HalfPrecision`` and
    ``BitsandbytesPrecision`` alike), ``chunked_cross_entropy`` takes each chunk's cross-entropy
    (reduction none, ignore_index -1) and the mean of their concatenation. lora.py keeps ``logits``
    through ``fabric.backward`` (until the next iteration rebinds it): held here until the next call.
    The next iteration's batch is random and shorter than the first, forced-longest one, so its peak is
    lower even with these logits still alive: the first is the peak modelled."""
    held = []

    def loss_fn(model, batch):
        held.clear()
        input_ids, targets = batch["input_ids"], batch["labels"]
        if model.max_seq_length != input_ids.size(1):
            model.max_seq_length = input_ids.size(1)
        logits = model(input_ids, lm_head_chunk_size=chunk_tokens)
        logits = [piece.to(torch.get_default_dtype()) for piece in logits]  # Fabric's convert_output
        logits[-1] = logits[-1][..., :-1, :]
        targets = targets[..., 1:]
        pieces = [piece.reshape(-1, piece.size(-1)) for piece in logits]
        target_pieces = [t.reshape(-1) for t in targets.split(logits[0].size(1), dim=1)]
        losses = [F.cross_entropy(piece, t, ignore_index=-1, reduction="none")
                  for piece, t in zip(pieces, target_pieces)]
        held.append(logits)
        return torch.cat(losses).mean()

    return loss_fn


class _SoftmaxKeepsInput(torch.autograd.Function):
    """torch 1.10's softmax autograd, for the 2022 rows: its backward formula named ``self`` (only for
    double backward), so the input stayed saved with the output (pytorch/pytorch#64000, #49600; the fix,
    #65242, relanded as #66018 on 2021-10-01, is first in 1.11 as far as found). Under autocast the input kept is autocast's fp32 copy (softmax
    is on autocast's fp32 list). The values are torch's own; only what is saved differs from today's."""

    @staticmethod
    def forward(ctx, x, dim):
        ctx.in_dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            x = x.float()
        out = torch.softmax(x, dim)
        ctx.dim = dim
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, ctx.dim, x.dtype).to(ctx.in_dtype), None


def _softmax_keeps_input(x, dim=None, _stacklevel=3, dtype=None):
    return _SoftmaxKeepsInput.apply(x if dtype is None else x.to(dtype), dim)


LOSSES = {"torchtune": lambda spec: torchtune_loss(spec["chunks"], spec.get("compiled", False),
                                                  spec.get("head_on_device", False), spec["recipe"],
                                                  spec.get("sharded", False)),
          "litgpt": lambda spec: litgpt_loss(spec["chunk_tokens"])}


# --- one row -------------------------------------------------------------------------------------

def _model(row):
    """What ``estimate`` gets as the model (and its batch, for heads the catalog does not build)."""
    if "torchtune" in row:  # torchtune's own decoder, and PackedDataset's batch (tokens, labels, input_pos)
        from bench.published import _torchtune_1814feb as torchtune_1814feb

        name = row["torchtune"]
        return (lambda: torchtune_1814feb.build(name)), torchtune_1814feb.batch(row["batch_size"], row["seq_len"])
    if "litgpt" in row:  # LitGPT's own GPT, and lora.py's batch: the longest sample, labels padded with -1
        from bench.published import _litgpt_8641822 as litgpt_8641822

        spec, rows, seq = row["litgpt"], row["batch_size"], row["seq_len"]
        batch = lambda: {"input_ids": torch.randint(0, 30000, (rows, seq)),  # noqa: E731
                         "labels": torch.randint(0, 30000, (rows, seq))}
        return (lambda: litgpt_8641822.build(spec["name"], spec.get("quantize"))), batch
    if "config" not in row:
        return row["model"], None
    from transformers import AutoConfig

    from memfit.models.catalog import lookup

    entry = lookup(row["model"])
    config = AutoConfig.for_model(entry.model_type, **{**entry.config, **row["config"]})
    if row.get("head") != "sequence-classification":
        return config, None
    from transformers import AutoModelForSequenceClassification

    rows, seq = row["batch_size"], row["seq_len"]
    batch = lambda: {"input_ids": torch.randint(100, 30000, (rows, seq)),  # noqa: E731 the guide's data
                     "labels": torch.zeros(rows, dtype=torch.long)}
    return (lambda: AutoModelForSequenceClassification.from_config(config)), batch


def _optimizer(row, recipe: dict, missing: list) -> None:
    """Pick the torchao optimizer a row names if this tree has one by name, else keep the row's
    stand-in (same state bytes) and say so."""
    lib = row.get("optimizer_lib")
    if not lib:
        return
    choices = next(f.choices for f in fields() if f.name == "optimizer")
    bits = "fp8" if lib.endswith("fp8") else re.search(r"\d+bit", recipe["optimizer"]).group()
    named = [c for c in choices if re.search(r"(^|_)(ao|torchao)(_|$)", c) and bits in c.replace("_", "")]
    if named:
        recipe["optimizer"] = named[0]
    elif recipe["optimizer"] != "adamw4bit":  # main's adamw4bit is torchao's already
        missing.append(f"torchao {bits} optimizer")  # bitsandbytes' of the same bits stands in: same state bytes


def _estimate_parameters():
    """The training estimate's keywords: ``memfit.estimate`` is a ``**kwargs`` front (training or generate) since
    the generate workload came, so its own signature names none of them."""
    try:
        from memfit.estimator.estimate import estimate as training
    except ImportError:  # an older tree: memfit.estimate is the training estimate itself
        training = memfit.estimate
    return inspect.signature(training).parameters


def _loss(row, recipe: dict):
    """The row's loss function. torchtune compiles its loss too (where the recipe keeps it), and keeps its output
    projection out of activation offloading."""
    spec = dict(row["loss"], compiled=recipe.get("compile") == "layers",
                head_on_device=row["loss"]["kind"] == "torchtune" and bool(recipe.get("offload_activations")),
                sharded=recipe.get("parallel") == "fsdp")
    return LOSSES[spec["kind"]](spec)


# torchtune's decoder at two small layers: a row's step run here by gpu_check --smoke (the plumbing, no GPU)
_SMOKE_TORCHTUNE = dict(vocab_size=4096, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=256,
                        intermediate_dim=128, norm_eps=1e-5, rope_base=500_000, scale_factor=8)


def row_step(row_id: str, smoke: bool = False):
    """(model factory, batch function, loss function, Recipe fields) of a torchtune or LitGPT row's step as
    ``estimate_row`` estimates it, to run that same step for real on a card (``bench/gpu/gpu_check.py``'s
    ``published-*`` cases). ``smoke``: a torchtune row on two tiny layers."""
    row = next(r for r in ROWS if r["id"] == row_id)
    if "torchtune" not in row and "litgpt" not in row:
        raise ValueError(f"{row_id} runs a catalog model: gpu_check runs those by name")
    recipe = {k: v for k, v in row["recipe"].items() if k in {f.name for f in fields()}}
    build, batch = _model(row)
    if smoke and "torchtune" in row:
        from bench.published import _torchtune_1814feb as torchtune_1814feb

        tied = torchtune_1814feb.CONFIGS[row["torchtune"]]["tied"]
        # torchao's NF4 (QLoRA rows) takes whole groups of 16384 weights: every layer's linears 128 x 128 or more
        smoke = (dict(_SMOKE_TORCHTUNE, embed_dim=128, intermediate_dim=256, num_kv_heads=4)
                 if recipe.get("quant_impl") == "torchao" else _SMOKE_TORCHTUNE)
        build = lambda: torchtune_1814feb.TransformerDecoder(**smoke, tied=tied)  # noqa: E731
        batch = torchtune_1814feb.batch(2, 32, vocab=_SMOKE_TORCHTUNE["vocab_size"])
    return build, batch, _loss(row, recipe), recipe


def estimate_row(row) -> dict:
    known = {f.name for f in fields()}
    takes = _estimate_parameters()
    recipe = {k: v for k, v in row["recipe"].items() if k in known}
    missing = [k for k in row["recipe"] if k not in known]
    _optimizer(row, recipe, missing)
    kwargs = {"gpus": row["gpus"]} if row.get("gpus") else {}
    if row.get("packed") and "torchtune" not in row:  # torchtune's decoder packs by its own input_pos
        if "packed" in takes:
            kwargs["packed"] = True
        else:
            missing.append("packed")
    if "loss" in row:
        kwargs["loss_fn"] = _loss(row, recipe)
    model, batch = _model(row)
    if row.get("softmax_keeps_input"):  # the 2022 stack's softmax (above) while this row is estimated
        from unittest import mock

        patch = mock.patch.object(F, "softmax", _softmax_keeps_input)
    elif row.get("torchao_step"):  # the run's torch and torchao compiled the 8-bit step otherwise (torchao_step.py)
        from bench.published.torchao_step import replayed

        patch = replayed(row["torchao_step"])
    else:
        patch = contextlib.nullcontext()
    start = time.perf_counter()
    try:
        with patch:
            report = memfit.estimate(model, batch, recipe=Recipe(**recipe), gpu=row["gpu"],
                                     batch_size=row["batch_size"] * row.get("gpus", 1), seq_len=row.get("seq_len"),
                                     **kwargs)
    except Exception:  # noqa: BLE001 a row that cannot run yet is reported, not fatal
        if recipe.get("optimizer") != "adamw4bit":
            raise
        missing.append("adamw4bit on fake tensors")  # 8-bit stands in: twice the 4-bit state
        recipe["optimizer"] = "adamw8bit"
        report = memfit.estimate(model, batch, recipe=Recipe(**recipe), gpu=row["gpu"], batch_size=row["batch_size"],
                                 seq_len=row.get("seq_len"), **kwargs)
    if str(recipe.get("optimizer", "")).startswith("paged") and not hasattr(report, "managed_bytes"):
        missing.append("managed_bytes")  # paged state still counted inside the allocator
    return _compare(row, report, recipe, missing, time.perf_counter() - start)


def _compare(row, report, recipe, missing, seconds) -> dict:
    published = round(row["value"] * UNITS[row["unit"]])
    estimate = getattr(report, FIGURE[row["metric"]])
    catalog = None
    if "published_context_mib" in row and row["metric"] == "nvidia-smi" and report.reserved_bytes is not None:
        # nvidia-smi counts what the process holds outside the allocator. The source measured its own context (CUDA
        # 11.2, eager module loading: every torch kernel loaded at init, 1343 MiB); cuBLAS then loads at the first
        # matmul. The default (today's lazy loading, the catalog's context) is kept as error_with_catalog_context.
        from memfit.hardware.gpus import gpu as card
        from memfit.hardware.outside import Workload, outside

        held = outside(card(row["gpu"]), Workload(eager_loading=True, context_bytes=row["published_context_mib"] * 2**20))
        catalog, estimate = estimate, report.reserved_bytes + held.bytes
    out = {k: row[k] for k in ("id", "source", "commit", "date", "table", "quote", "metric", "gpu", "model", "note")}
    out.update(value=row["value"], unit=row["unit"], published_bytes=published, estimate_bytes=estimate,
               error=(estimate - published) / published, missing=missing, recipe=recipe,
               seq_len=row.get("seq_len"), batch_size=row["batch_size"], packed=bool(row.get("packed")),
               loss=row.get("loss"), peak_bytes=report.peak_bytes, reserved_bytes=report.reserved_bytes,
               device_bytes=report.device_bytes, verdict=report.verdict, seconds=round(seconds, 1),
               managed_bytes=getattr(report, "managed_bytes", None), headline=bool(row.get("headline")),
               gpus=row.get("gpus", 1), host_bytes=getattr(report, "host_bytes", None))
    if catalog is not None:
        out["error_with_catalog_context"] = (catalog - published) / published
    for found in floors.row_floors([row]).values():  # what its stated settings must hold at one moment (_floors.py)
        out.update(floor_bytes=found["bytes"], floor_moment=found["moment"], floor_terms=found["terms"])
    return out


# --- the table -----------------------------------------------------------------------------------

def summary(rows: list[dict]) -> dict:
    done = [r for r in rows if "error" in r and r.get("error") is not None]
    errors = [abs(r["error"]) for r in done]
    complete = [abs(r["error"]) for r in done if not r["missing"]]
    worst = max(done, key=lambda r: abs(r["error"])) if done else None
    below = [r for r in done if r.get("floor_bytes", 0) > r["published_bytes"]]
    reachable = [r for r in done if r not in below]
    within = max(reachable, key=lambda r: abs(r["error"])) if reachable else None
    return {"rows": len(done), "median_abs_error": statistics.median(errors) if errors else None,
            "complete_rows": len(complete),
            "median_abs_error_complete": statistics.median(complete) if complete else None,
            "worst": {"id": worst["id"], "error": worst["error"]} if worst else None,
            "beyond_10_percent": [r["id"] for r in done if abs(r["error"]) > 0.10],
            "beyond_6_percent": [r["id"] for r in done if abs(r["error"]) > 0.06],
            # published figures below what their rows' stated settings must hold (_floors.py): no exact estimate of
            # those settings comes within the floor's distance of them
            "below_floor": {r["id"]: {"floor_bytes": r["floor_bytes"],
                                      "over_published": r["floor_bytes"] / r["published_bytes"] - 1} for r in below},
            "worst_reachable": {"id": within["id"], "error": within["error"]} if within else None,
            "not_estimated": {r["id"]: r["failed"] for r in rows if r.get("failed")},
            "headline": [{"id": r["id"], "verdict": r["verdict"], "device_bytes": r["device_bytes"]}
                         for r in done if r.get("headline")]}


def _gib(n) -> str:
    return "" if n is None else f"{n / 2**30:.2f} GiB"


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"memfit vs published GPU peaks ({result['meta']['date']})", expand=False)
    for col in ("row", "metric", "published", "memfit", "error", "missing"):
        table.add_column(col)
    for r in _results.table(result, "published"):
        table.add_row(r["id"], r["metric"], f"{r['value']} {r['unit']}", _gib(r.get("estimate_bytes")),
                      f"{r['error']:+.1%}" if r.get("error") is not None else r.get("failed", ""),
                      ", ".join(r.get("missing", [])))
    Console(width=150).print(table)
    s = result["summary"]
    print(f"{s['rows']} rows: median |error| {s['median_abs_error']:.1%}; "
          f"{s['complete_rows']} rows missing nothing: median {s['median_abs_error_complete'] or 0:.1%}; "
          f"worst {s['worst']['id']} {s['worst']['error']:+.1%}; beyond 10%: {', '.join(s['beyond_10_percent'])}")
    for rid, floor in s.get("below_floor", {}).items():
        print(f"published below its stated settings' floor: {rid}, floor {_gib(floor['floor_bytes'])} "
              f"({floor['over_published']:+.1%} over the published figure)")
    if s.get("below_floor") and s.get("worst_reachable"):
        print(f"worst of the other rows: {s['worst_reachable']['id']} {s['worst_reachable']['error']:+.1%}")
    for rid, why in s["not_estimated"].items():
        print(f"not estimated: {rid}: {why}")
    for h in s["headline"]:
        print(f"headline {h['id']}: {h['verdict']} ({_gib(h['device_bytes'])} on the device)")


SOURCES = {"torchtune": "torchtune README", "torchao": "torchao optim README", "transformers": "HF single-GPU guide",
           "litgpt": "LitGPT resource tables"}


def markdown(result: dict) -> str:
    lines = ["| row | source | measured | published | = GiB | memfit GiB | error | missing in this tree |"
             " stated settings' floor |", "|---|---|---|---|---|---|---|---|---|"]
    for r in _results.table(result, "published"):
        source = next((v for k, v in SOURCES.items() if k in r.get("source", "")), "")
        if r.get("error") is None:
            lines.append(f"| {r['id']} | {source} | {r['metric']} | {r['value']} {r['unit']} | | not estimated | | "
                         f"{r.get('failed', '')[:90]} | |")
            continue
        floor = (f"{r['floor_bytes'] / 2**30:.2f} GiB ({r['floor_bytes'] / r['published_bytes'] - 1:+.1%})"
                 if r.get("floor_bytes") else "")
        lines.append(f"| {r['id']} | {source} | {r['metric']} | {r['value']} {r['unit']} | "
                     f"{r['published_bytes'] / 2**30:.2f} | {r['estimate_bytes'] / 2**30:.2f} | {r['error']:+.1%} | "
                     f"{', '.join(r['missing']) or '—'} | {floor} |")
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


#: a row whose source leaves its run open -> the other readings of it, each (label, Recipe fields changed, row keys
#: changed): run by ``--variants`` to show what each reading gives (docs/results.md, "Why rows miss")
VARIANTS = {"tt-3b-adamw8bit": [
    ("torchao AdamW8bit, today's step (torch 2.13)", {}, {"torchao_step": None}),
    ("bitsandbytes AdamW8bit (unpaged)", {"optimizer": "adamw8bit"}, {"torchao_step": None}),
    ("bitsandbytes PagedAdamW8bit (the config's default)", {"optimizer": "paged_adamw8bit"}, {"torchao_step": None}),
    ("torchao AdamW8bit (2.5.1 step), no optimizer-in-backward", {"optimizer_in_backward": False}, {}),
    ("PagedAdamW8bit, no optimizer-in-backward", {"optimizer": "paged_adamw8bit", "optimizer_in_backward": False},
     {"torchao_step": None})],
    # the 8B table's rows beyond 6 %: settings the README's note does not pin (its configs have activation offloading
    # off; the packed length is the note's 2048)
    "tt-8b-lora-4090": [("activation offloading on", {"offload_activations": True}, {}),
                        ("2 x 1024 tokens", {}, {"seq_len": 1024})],
    "tt-8b-full-4090": [("activation offloading on", {"offload_activations": True}, {}),
                        ("2 x 1024 tokens", {}, {"seq_len": 1024})],
    # the table's QLoRA row under the same two readings: the one row they do not bring in
    "tt-8b-qlora-4090": [("activation offloading on", {"offload_activations": True}, {}),
                         ("2 x 1024 tokens", {}, {"seq_len": 1024})],
    "tt-70b-lora-8xa100": [("2 x 1024 tokens a rank", {}, {"seq_len": 1024}),
                           ("reshard_after_forward false (ZeRO-2-like)", {"reshard_after_forward": "false"}, {})],
    # left out (EXCLUDED): as stated, and as 405B_qlora.yaml's batch_size 1 at the note's 2048 tokens
    "tt-405b-qlora-8xa100": [("the config's batch 1 (2048 tokens)", {}, {"batch_size": 1})]}


def variants(only: set | None = None) -> list[dict]:
    """Each row of ``VARIANTS`` (``only``: those ids) as mapped and under its other readings."""
    by_id, out = {r["id"]: r for r in ROWS + [TT_405B_QLORA]}, []
    for row_id, changes in VARIANTS.items():
        if only and row_id not in only:
            continue
        for label, recipe_changed, row_changed in [("as mapped", {}, {})] + changes:
            row = dict(by_id[row_id], recipe=dict(by_id[row_id]["recipe"], **recipe_changed), **row_changed)
            result = estimate_row(row)
            out.append({"id": row_id, "variant": label, "recipe": result["recipe"], "error": result["error"],
                        "estimate_bytes": result["estimate_bytes"], "published_bytes": result["published_bytes"]})
            print(f"{row_id:18} {label:60} {result['error']:+.1%}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (merged into the results file)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the README table from the results file")
    parser.add_argument("--variants", action="store_true", help="estimate the undiagnosed rows' other readings")
    args = parser.parse_args()
    if args.variants:  # with --rows: those rows' variants, merged into the file
        only = set(args.rows.split(",")) if args.rows else None
        done = variants(only)
        if only and _results.path(RESULTS[1]).exists():
            kept = [v for v in _results.read(RESULTS[1])["rows"] if v["id"] not in only]
            done = kept + done
        print(f"wrote {_results.write(RESULTS[1], done, memfit_commit=_commit())}")
        return
    if args.markdown:
        print(markdown(_results.read(RESULTS[0])))
        return
    wanted = set(args.rows.split(",")) if args.rows else {r["id"] for r in ROWS}
    unknown = wanted - {r["id"] for r in ROWS}
    if unknown:
        sys.exit(f"unknown row(s) {', '.join(sorted(unknown))}: see bench/published/_rows.py")
    done = {}
    for row in (r for r in ROWS if r["id"] in wanted):
        print(f"{row['id']} ...", file=sys.stderr, flush=True)
        try:
            done[row["id"]] = estimate_row(row)
        except Exception as err:  # noqa: BLE001 one row's failure is a result, not the end of the run
            done[row["id"]] = {"id": row["id"], "source": row["source"], "table": row["table"], "metric": row["metric"],
                               "value": row["value"],
                               "unit": row["unit"], "failed": f"{type(err).__name__}: {str(err)[:200]}",
                               "missing": []}
        print(f"  {json.dumps({k: done[row['id']].get(k) for k in ('error', 'missing', 'seconds', 'failed')})}",
              file=sys.stderr, flush=True)
    old = {}
    if args.rows and _results.path(RESULTS[0]).exists():
        old = {r["id"]: r for r in _results.table(_results.read(RESULTS[0]), "published")}
    rows = [done.get(r["id"]) or old.get(r["id"]) for r in ROWS if r["id"] in done or r["id"] in old]
    features = sorted({f.name for f in fields()} & {"compile", "lora_targets", "lora_alpha", "lora_dropout", "lora_dtype",
                                                    "offload_gradients", "activation_memory_budget"})
    path = _results.write(RESULTS[0], _results.tables(published=rows, excluded=EXCLUDED), summary(rows),
                          memfit_commit=_commit(), features=features,
                          estimate_takes_packed="packed" in _estimate_parameters())
    if args.json:
        print(path.read_text())
    else:
        print_table(_results.read(path))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
