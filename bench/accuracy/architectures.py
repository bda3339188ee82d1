"""Every architecture transformers ships with a language-model head: tiny, trained two AdamW steps on
CPU, against memfit's estimate.

    python -m bench architectures                     # the whole sweep (~285 entries), 2 at a time
    python -m bench architectures --only qwen3/causal,bart/seq2seq
    python -m bench architectures --jobs 1 --timeout 180

The entries are those of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_MASKED_LM_MAPPING_NAMES`` and ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``; a
model type in several mappings is one entry per mapping (``bart/masked``, ``bart/seq2seq``). Each
is built tiny from its own config class (``tiny_config``: 2 blocks of width 64, 4 heads, small
feed-forward and vocabulary), given the mapping's class as ``architectures`` (so memfit builds the
head the mapping names) and run in its own process under a time limit. An entry ends as

    within      |estimate - truth| / truth <= 1%
    off         more than 1% off (a memfit bug)
    refused     memfit raised a MemfitError: its one line says why
    traceback   memfit raised anything else (a memfit bug)
    cannot-run  the tiny config cannot be built, or the plain two-step run without memfit fails
    timeout     the process passed its time limit

The truth is ``memfit.estimator.truth.true_peak`` (the CPU allocator's own events over the two
steps, plus what existed before them); the estimate is ``memfit.estimate`` of the same two steps on
the same batch (2 x 32 tokens, fp32). Writes bench/results/architectures-cpu.json after every
entry, and prints the summary table the README quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
from bench import _results  # noqa: E402
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

RESULTS = "architectures-cpu.json"
TOLERANCE = 0.01
KINDS = ("within", "off", "refused", "traceback", "cannot-run", "timeout")
MAPPINGS = {"causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}
BATCH, SEQ = 2, 32

# ---------------------------------------------------------------------------------------------
# the tiny config: every depth / width field a config class has, set small and consistent

WIDTH, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 128, 256
_DEPTH = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "num_encoder_layers",
          "encoder_layers", "decoder_layers")
_SET = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "embedding_size",
                     "projection_dim", "emb_dim"), WIDTH),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads", "attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num",
                     "num_attention_groups"), KV_HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_dim", "v_head_dim", "qk_nope_head_dim"),
                    HEAD_DIM),
    "qk_rope_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_head_dim": 32,
    **dict.fromkeys(("index_head_dim", "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim"), HEAD_DIM),
    **dict.fromkeys(("index_n_heads", "linear_num_heads", "linear_num_key_heads", "linear_num_value_heads"), 4),
    "num_kv_shared_layers": 1, "hidden_size_global": WIDTH, "encoder_hash_byte_group_vocab": 512,
    "mamba_d_ssm": 2 * WIDTH, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
                     "ffn_hidden_size", "dim_feedforward", "ffn_config_hidden"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size",
                     "expert_hidden_size"), 32),
    **dict.fromkeys(("shared_expert_intermediate_size", "shared_intermediate_size"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts", "num_local_experts_per_layer"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_selected_experts", "moe_k",
                     "num_experts_per_token"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 16),
    **dict.fromkeys(("mamba_n_groups", "n_groups"), 1),
    **dict.fromkeys(("mamba_expand", "expand"), 2),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 8),
}
# distilbert calls its width ``dim`` and its feed-forward ``hidden_dim``
_PAIRS = (("dim", "hidden_dim"),)
_SPECIAL = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
            "cls_token_id", "mask_token_id", "unk_token_id", "forced_bos_token_id", "forced_eos_token_id")
_SUBCONFIGS = ("text_config", "encoder", "decoder", "encoder_config", "decoder_config", "language_config",
               "llm_config", "thinker_config", "vision_config", "audio_config", "patcher_config", "global_config")


def _ids(value):
    return [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int)]


def _selection(d: dict, depth: int) -> list[int]:
    """The layers a tiny copy keeps: the first of each kind every per-layer pattern names (a hybrid
    keeps an attention layer beside its state-space ones), at least 2 and at most 4."""
    keep = {0}
    for key, value in d.items():
        if _per_layer(key, value, depth):
            seen = {}
            for i, v in enumerate(value):
                seen.setdefault(repr(v), i)
            keep.update(seen.values())
    keep = sorted(keep)[:4]
    for i in range(depth):
        if len(keep) >= 2:
            break
        keep = sorted(set(keep) | {i})
    return keep


def _per_layer(key, value, depth) -> bool:
    if key in _SPECIAL or key in ("architectures", "model_type") or depth < 2:
        return False
    return (isinstance(value, list) and len(value) == depth) or (
        isinstance(value, str) and "pattern" in key and len(value) == depth)


def _small(key, value):
    """The tiny value of one field (or ``value`` unchanged)."""
    if key in _SET and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return _SET[key] if key not in ("num_key_value_heads", "num_kv_heads") or value > 1 else value
    return value


def _scaled(key, value, default):
    """A per-layer override, tiny in the same ratio to the tiny default as it was to the default."""
    if isinstance(value, int) and isinstance(default, int) and default > 0 and key in _SET:
        return max(1, _small(key, default) * value // default)
    return _small(key, value)


def _tiny_dict(d: dict, mixed: bool = True) -> dict:
    """``d`` (a config's to_dict) with depth / width fields set small; sub-configs likewise.
    ``mixed``: keep one layer of each kind the per-layer patterns name, else the first two."""
    out = {}
    depth = next((d[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
                  if isinstance(d.get(k), int) and d[k] > 0), 0)
    keep = (_selection(d, depth) if mixed else [0, 1]) if depth else []
    if isinstance(d.get("block_types"), list) and len(d["block_types"]) > len(keep):  # RecurrentGemma's cycle
        keep = list(range(len(d["block_types"])))
    mla = isinstance(d.get("kv_lora_rank"), int)
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value and key in _SUBCONFIGS:
            out[key] = {**value, **_tiny_dict(value, mixed)}
        elif key in _DEPTH and isinstance(value, int) and value > 0:
            out[key] = len(keep) if value == depth and keep else 2
        elif _per_layer(key, value, depth):
            out[key] = [value[i] for i in keep] if isinstance(value, list) else "".join(value[i] for i in keep)
        elif key == "per_layer_config" and isinstance(value, dict):
            width = max([len(k) for k in value] + [1])
            out[key] = {str(keep.index(int(k))).zfill(width): {f: _scaled(f, v, d.get(f)) for f, v in layer.items()}
                        for k, layer in value.items() if int(k) in keep}
        elif (key.endswith(("_indices", "_idxs")) and isinstance(value, list) and keep
              and all(isinstance(v, int) for v in value)):
            out[key] = [keep.index(v) for v in value if v in keep] or [len(keep) - 1]
        elif key.endswith("_period") and isinstance(value, int) and value > 2:
            out[key], out[key.replace("_period", "_offset")] = 2, 1
        elif key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts") and value is None \
                and "moe_intermediate_size" in d:
            out[key] = _SET[key]
        else:
            small = _small(key, value)
            if small != value:
                out[key] = small
    if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] > 1:
        out["first_k_dense_replace"] = 1  # one dense block, one MoE block
    types = out.get("layer_types")
    if isinstance(types, list) and set(types) == {"linear_attention"} and "mamba_d_state" in d:
        out["layer_types"] = types[:-1] + ["attention"]  # Granite-4: a default of only Mamba blocks
    if d.get("attn_layer_indices", 0) is None:
        out["attn_layer_indices"] = [1]  # an attention block beside the state-space one
    if isinstance(d.get("expand"), int) and isinstance(d.get("num_heads"), int):  # Mamba-2: heads x dim = 2 x width
        out["num_heads"] = 2 * WIDTH // HEAD_DIM
    if isinstance(d.get("rotary_dim"), int):
        out["rotary_dim"] = HEAD_DIM // 2
    if mla:  # multi-head latent attention: the rope part is also the head_dim, q/k heads = k/v heads
        out.update({k: 16 for k in ("qk_rope_head_dim", "head_dim") if isinstance(d.get(k), int)})
        if isinstance(d.get("qk_head_dim"), int):
            out["qk_head_dim"] = 32
        if isinstance(d.get("num_key_value_heads"), int) and d["num_key_value_heads"] == d.get("num_attention_heads"):
            out["num_key_value_heads"] = HEADS
    for width, ffn in _PAIRS:
        if isinstance(d.get(width), int) and isinstance(d.get(ffn), int):
            out[width], out[ffn] = WIDTH, FFN
    return out


def _vocab(d: dict) -> dict:
    """A small vocabulary that still holds every special token id (ids past 1024 are moved in)."""
    out = {}
    if "vocab_size" not in d or not isinstance(d["vocab_size"], (int, type(None))):
        return out
    specials = [i for k in d if k in _SPECIAL or k.endswith("_token_id") for i in _ids(d[k])]
    kept = [i for i in specials if i < 1024]
    vocab = max([VOCAB - 1] + kept) + 1
    out["vocab_size"] = vocab
    for key in d:
        if (key in _SPECIAL or key.endswith("_token_id")) and any(i >= vocab for i in _ids(d[key])):
            value = d[key]
            moved = [i if i < vocab else vocab - 1 - n for n, i in enumerate(_ids(value))]
            out[key] = moved if isinstance(value, (list, tuple)) else moved[0]
    return out


def tiny_config(model_type: str, architecture: str | None = None):
    """The config class of ``model_type`` at a tiny size, naming ``architecture`` as its head."""
    try:
        return _tiny_config(model_type, architecture, mixed=True)
    except Exception:  # noqa: BLE001 — a config whose layer counts must add up (Dory): the first two layers
        return _tiny_config(model_type, architecture, mixed=False)


def _tiny_config(model_type: str, architecture: str | None, mixed: bool):
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type).to_dict()
    tiny = _tiny_dict(base, mixed)
    tiny.update(_vocab({**base, **tiny}))
    for key, value in list(tiny.items()):
        if isinstance(value, dict) and key in _SUBCONFIGS:
            value.update(_vocab(value))
    args = {k: v for k, v in tiny.items() if k not in ("model_type", "transformers_version")}
    config = AutoConfig.for_model(model_type, **args)
    if getattr(config, "is_encoder_decoder", False):  # shift_tokens_right needs both (T5's default has neither)
        for key in ("pad_token_id", "decoder_start_token_id"):
            if getattr(config, key, None) is None:
                setattr(config, key, 0)
    if architecture:
        config.architectures = [architecture]
    return config


def entries() -> list[tuple[str, str, str]]:
    """(model_type, mapping, class name) for every entry of the three mappings."""
    from transformers.models.auto import modeling_auto

    return [(model_type, short, cls) for short, attr in MAPPINGS.items()
            for model_type, cls in getattr(modeling_auto, attr).items()]


# ---------------------------------------------------------------------------------------------
# one entry, in its own process


def _line(err: BaseException) -> str:
    text = " ".join(str(err).split())[:300]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _plain_run(config, cls: str, batch) -> None:
    """Two AdamW steps of the mapping's class with nothing of memfit's: does the model train at all?"""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, cls)(config)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        out = model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def run_one(model_type: str, mapping: str) -> dict:
    import torch

    import memfit
    from memfit.errors import MemfitError
    from memfit.estimator.truth import true_peak
    from memfit.models.source import resolve

    cls = dict((m, c) for t, m, c in entries() if t == model_type)[mapping]
    row = {"name": f"{model_type}/{mapping}", "model_type": model_type, "mapping": mapping, "class": cls}
    try:
        config = tiny_config(model_type, cls)
    except Exception as err:  # noqa: BLE001 — the config class itself refuses the tiny sizes
        return {**row, "result": "cannot-run", "why": f"tiny config: {_line(err)}"}
    stage = "source"
    try:
        source = resolve(config)
        row["task"] = source.task
        torch.manual_seed(0)
        stage = "batch"
        batch = source.make_batch(BATCH, SEQ)
    except MemfitError as err:
        return {**row, "result": "refused", "why": str(err)}
    except Exception as err:  # noqa: BLE001
        return {**row, "result": "traceback", "why": f"{stage}: {_line(err)}"}
    try:
        _plain_run(config, cls, batch)
    except Exception as err:  # noqa: BLE001 — the model cannot train tiny, memfit or not
        return {**row, "result": "cannot-run", "why": f"plain run: {_line(err)}"}
    try:
        stage = "estimate"
        report = memfit.estimate(source, batch, precision="fp32")
        built = type(source.build()).__name__
        stage = "truth"
        truth = true_peak(source.build, batch, precision="fp32")
    except MemfitError as err:
        return {**row, "result": "refused", "why": str(err)}
    except Exception as err:  # noqa: BLE001
        import traceback

        where = traceback.extract_tb(err.__traceback__)[-1]
        return {**row, "result": "traceback",
                "why": f"{stage}: {_line(err)} ({os.path.basename(where.filename)}:{where.lineno})"}
    error = (report.peak_bytes - truth) / truth
    return {**row, "built": built, "estimated": report.peak_bytes, "measured": truth, "error": error,
            "unprobed_ops": report.unprobed_ops, "result": "within" if abs(error) <= TOLERANCE else "off"}


# ---------------------------------------------------------------------------------------------
# the sweep


def _spawn(name: str, timeout: float) -> dict:
    model_type, mapping = name.rsplit("/", 1)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--one", model_type, mapping], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "model_type": model_type, "mapping": mapping, "result": "timeout",
                "why": f"over {timeout:.0f} s", "seconds": round(time.perf_counter() - start, 1)}
    last = done.stdout.strip().splitlines()[-1:] or [""]
    try:
        row = json.loads(last[0])
    except ValueError:
        tail = " ".join(done.stderr.strip().splitlines()[-1:])[:300]
        row = {"name": name, "model_type": model_type, "mapping": mapping, "result": "traceback",
               "why": f"process died (rc {done.returncode}): {tail}"}
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def summary(rows: list[dict]) -> str:
    """The README's table: one line per result, with counts per mapping."""
    lines = ["| result | causal LM | masked LM | seq2seq | all |", "|---|---:|---:|---:|---:|"]
    for kind in KINDS:
        counts = [sum(r["result"] == kind and r["mapping"] == m for r in rows) for m in MAPPINGS]
        lines.append(f"| {kind} | " + " | ".join(map(str, counts)) + f" | {sum(counts)} |")
    totals = [sum(r["mapping"] == m for r in rows) for m in MAPPINGS]
    lines.append("| **entries** | " + " | ".join(map(str, totals)) + f" | {len(rows)} |")
    return "\n".join(lines)


def _save(rows_by_name: dict) -> None:
    rows = sorted(rows_by_name.values(), key=lambda r: r["name"])
    _results.write(RESULTS, rows, {"counts": {k: sum(r["result"] == k for r in rows) for k in KINDS}},
                   batch=BATCH, seq_len=SEQ, precision="fp32", optimizer="adamw", steps=2, tolerance=TOLERANCE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("MODEL_TYPE", "MAPPING"), help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated entries (model_type/mapping, or a model_type: all its)")
    parser.add_argument("--jobs", type=int, default=2, help="processes at once (the machine has 2 cores)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per entry")
    args = parser.parse_args()
    if args.one:
        import warnings

        warnings.filterwarnings("ignore")
        print(json.dumps(run_one(*args.one)), flush=True)
        return
    names = [f"{t}/{m}" for t, m, _ in entries()]
    if args.only:
        wanted = set(args.only.split(","))
        names = [n for n in names if n in wanted or n.rsplit("/", 1)[0] in wanted]
    previous = _results.read(RESULTS)["rows"] if _results.path(RESULTS).exists() else []
    rows = {r["name"]: r for r in previous}
    with ThreadPoolExecutor(args.jobs) as pool:
        for future in as_completed([pool.submit(_spawn, n, args.timeout) for n in names]):
            row = future.result()
            rows[row["name"]] = row
            error = f"{100 * row['error']:+.3f}%" if "error" in row else ""
            print(f"{row['name']:36} {row['result']:10} {error:>9} {row.get('seconds', 0):6.1f}s "
                  f"{row.get('why', '')[:150]}", flush=True)
            _save(rows)
    print(summary(list(rows.values())))


if __name__ == "__main__":
    main()
