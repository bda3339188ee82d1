"""``memfit train``: train a model inside a memory budget (``memfit.training.loop.train``).

Flags, or a YAML file (``--config``) whose keys are the flags' names (``seq_len``, ``steps``, ...);
a flag on the command line wins over the file. ``--recipe auto`` plans first (``memfit plan`` for
the budget) and trains the plan's recipe.
"""

from __future__ import annotations

import json
import sys

from memfit.cli import _args
from memfit.errors import MemfitError

# flag name -> default, for the flags a --config file may set (the rest are the Recipe's own)
_DEFAULTS = {"data": None, "tokenizer": None, "seq_len": None, "global_batch_size": None, "global_tokens": None,
             "steps": None, "epochs": None, "lr": 1e-4, "schedule": "cosine", "warmup": 0, "budget": None,
             "out_dir": "memfit-run", "resume": True, "seed": 0, "checkpoint_every": 50, "keep": 2,
             "device": None, "recipe": None, "dtype": "uint16", "workers": 0, "gpu": None, "tensorboard": None,
             "packed": False}


def build(train) -> None:
    _args.add_model(train)
    train.add_argument("--config", default=None, help="a YAML file of these flags' values (flags win)")
    train.add_argument("--data", default=None, help="a nanoGPT .bin token file, a .jsonl file (text or input_ids) "
                       "or a saved datasets directory")
    train.add_argument("--tokenizer", default=None, help="a local tokenizer directory (for .jsonl text)")
    train.add_argument("--dtype", default=None, help="the token file's dtype (default uint16)")
    _args.add_seq_len(train)
    train.add_argument("--global-batch-size", type=_args.positive, default=None, help="examples per optimizer step")
    train.add_argument("--global-tokens", type=_args.positive, default=None, help="tokens per optimizer step "
                       "(instead of --global-batch-size)")
    train.add_argument("--steps", type=_args.positive, default=None, help="optimizer steps to run in total")
    train.add_argument("--epochs", type=float, default=None, help="passes over the data (instead of --steps)")
    train.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-4)")
    train.add_argument("--schedule", choices=("constant", "cosine"), default=None, help="after warmup (default cosine)")
    train.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default 0)")
    _args.add_budget(train, help="memory the run may use, e.g. 24GiB: on the CPU a virtual budget (real tensors, "
                     "an OOM past it), on CUDA the process's memory fraction")
    train.add_argument("--device", choices=("cpu", "cuda"), default=None, help="where to train (default: cuda if "
                       "available)")
    train.add_argument("--gpu", default=None, help="on CUDA, the catalog GPU the micro-batch estimates follow "
                       "(see `memfit gpus`; default h100-sxm); without --budget its memory is the budget")
    train.add_argument("--packed", action="store_true", default=None, help="pack documents into rows of --seq-len "
                       "tokens, attention within each document (causal LMs)")
    train.add_argument("--workers", type=int, default=None, help="DataLoader worker processes (default 0)")
    train.add_argument("--tensorboard", dest="tensorboard", action="store_true", default=None,
                       help="require TensorBoard scalars in --out-dir/tensorboard (default: when installed)")
    train.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                       help="no TensorBoard scalars even if installed")
    train.add_argument("--out-dir", default=None, help="checkpoints and metrics.jsonl (default memfit-run)")
    train.add_argument("--no-resume", dest="resume", action="store_false", default=None,
                       help="start fresh even if --out-dir has checkpoints")
    train.add_argument("--seed", type=int, default=None, help="data order and initialisation (default 0)")
    train.add_argument("--checkpoint-every", type=_args.positive, default=None, help="steps between checkpoints "
                       "(default 50; always at the end)")
    train.add_argument("--keep", type=_args.positive, default=None, help="checkpoints kept (default 2)")
    train.add_argument("--recipe", default=None, help="a recipe .yaml/.json, or auto (plan for --budget first); "
                       "flags below override its fields")
    _args.recipe_flags(train)
    _args.add_json(train, help="print the result as JSON (the progress bar goes to stderr)")


def _settings(args) -> dict:
    values = dict(_DEFAULTS)
    if args.config:
        import yaml

        try:
            with open(args.config, encoding="utf-8") as fh:
                loaded = yaml.safe_load(fh) or {}
        except OSError as err:
            raise MemfitError(f"cannot read --config {args.config}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise MemfitError(f"--config {args.config} is not YAML ({str(err).splitlines()[0]})") from None
        if not isinstance(loaded, dict):
            raise MemfitError(f"--config {args.config} must be a mapping of flag names to values")
        unknown = sorted(set(loaded) - set(_DEFAULTS) - {"model"})
        if unknown:
            raise MemfitError(f"unknown key {unknown[0]!r} in {args.config}: use the flags' names "
                              f"({', '.join(sorted(_DEFAULTS))})")
        values.update({k.replace("-", "_"): v for k, v in loaded.items() if k != "model"})
    for key in _DEFAULTS:
        given = getattr(args, key, None)
        if given is not None:
            values[key] = given
    return values


def run(args) -> int:
    import torch

    from memfit.models.source import resolve
    from memfit.techniques.recipe import Recipe
    from memfit.training.loop import train
    from memfit.units import format_size, parse_size

    s = _settings(args)
    if s["data"] is None:
        raise MemfitError("no data: pass --data (a .bin token file, a .jsonl file or a saved dataset directory)")
    if s["seq_len"] is None:
        raise MemfitError("pass --seq-len: the longest example the run takes, in tokens")
    device = s["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    budget = None if s["budget"] is None else parse_size(s["budget"])
    recipe_arg = s["recipe"]
    if recipe_arg == "auto":
        if budget is None:
            raise MemfitError("--recipe auto plans for a budget: pass --budget")
        from memfit.planner.plan import plan

        rows = s["global_batch_size"] or max(1, (s["global_tokens"] or s["seq_len"]) // s["seq_len"])
        plans = plan(_args.model_of(args), budget=budget, global_batch_size=rows, seq_len=s["seq_len"],
                     device="cpu" if device == "cpu" else "cuda")
        base = plans.best.recipe
    else:
        base = Recipe.load(recipe_arg) if recipe_arg else Recipe()
    changes = {name: getattr(args, name) for name in Recipe.fields() if getattr(args, name, None) is not None}
    recipe = base.replace(**changes) if changes else base
    source = resolve(_args.model_of(args))
    torch.manual_seed(s["seed"])
    model = source.build().to(device)
    from memfit.training.data import open_data

    data = open_data(s["data"], seq_len=s["seq_len"], tokenizer=s["tokenizer"], dtype=s["dtype"])
    result = train(model, data, recipe=recipe, budget=budget, global_batch_size=s["global_batch_size"],
                   global_tokens=s["global_tokens"], seq_len=s["seq_len"], steps=s["steps"], epochs=s["epochs"],
                   lr=float(s["lr"]), schedule=s["schedule"], warmup=int(s["warmup"]), out_dir=s["out_dir"],
                   resume=bool(s["resume"]), seed=int(s["seed"]), checkpoint_every=int(s["checkpoint_every"]),
                   keep=int(s["keep"]), workers=int(s["workers"]), gpu=s["gpu"], tensorboard=s["tensorboard"],
                   packed=bool(s["packed"]), progress=True)
    summary = {"steps": result.steps, "resumed_from": result.resumed_from,
               "final_loss": result.losses[-1] if result.losses else None, "ooms": result.ooms,
               "peak_bytes": result.peak_bytes, "tokens_per_second": round(result.tokens_per_second, 1),
               "out_dir": str(result.out_dir), "recipe": recipe.to_dict()}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        loss = "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
        print(f"trained {result.steps} steps (resumed at {result.resumed_from}); loss {loss}; "
              f"{result.tokens_per_second:,.0f} tokens/s; peak {format_size(result.peak_bytes)}; "
              f"{len(result.ooms)} out-of-memory errors survived; checkpoints in {result.out_dir}", file=sys.stdout)
    return 0
