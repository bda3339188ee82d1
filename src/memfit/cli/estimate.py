"""``memfit estimate``: the memory of one training step, on fake tensors; with ``--generate``, of a Hugging Face
``generate`` (prefill, then decode: ``memfit.generation``)."""

from __future__ import annotations

import dataclasses
import json
import sys

from memfit.cli import _args
from memfit.errors import MemfitError


def build(est) -> None:
    est.usage = "%(prog)s MODEL [flags] | %(prog)s [flags] SCRIPT.py [its args] | %(prog)s [flags] -m MODULE"
    est.description = ("A model by name with recipe flags, or your own training script: memfit estimate [--gpu CARD] "
                       "[--steps N] [--device cpu] [--json] SCRIPT.py [its args] (or -m MODULE): the script runs on "
                       "fake tensors, its 'cuda' is the card; memfit's flags go before the script.")
    est.epilog = "The flags a script takes: memfit estimate --help SCRIPT.py. More: docs/estimate.md."
    _args.add_model(est, optional=True)
    _args.add_loss(est)
    _args.add_recipe(est)
    _args.add_from(est)
    batch = _args.section(est, "batch")
    batch.add_argument("--batch-size", type=_args.positive, metavar="N", default=None,
                       help="examples per optimizer step (default 1; = --micro-batch-size x --grad-accum-steps)")
    _args.add_seq_len(est)
    _args.add_world(est, help="GPUs per node (default 1), or those --device-map uses: the report is the "
                    "worst rank's")
    _args.recipe_flags(est)
    many = _args.section(est, "parallel")
    many.add_argument("--device-map", default=None, metavar="MAP",
                      help="place the model as from_pretrained(device_map=...): auto, balanced, sequential or a .json")
    many.add_argument("--max-memory", default=None, metavar="MAP",
                      help="with --device-map: each device's budget, e.g. 0=70GB,1=70GB,cpu=100GB (default: the cards)")
    many.add_argument("--offload-folder", default=None, metavar="DIR",
                      help="with --device-map: where modules placed on disk live (needed when any are)")
    _args.section(est, "generation").add_argument(
        "--forward-only", action="store_true",
        help="forwards without gradients (no_grad, eval mode) instead of training steps (default off)")
    tracing = _args.section(est, "tracing")
    tracing.add_argument("--steps", type=_args.positive, default=2, metavar="N",
                         help="steps to run; step 2 has optimizer state (default 2)")
    _args.add_budget(est, help="bytes the process may use on the card, e.g. 24GiB, 24GB, 80G (default: the whole card)")
    _args.add_device(est, None, help="cuda (default: the card's allocator and verdict) | cpu (the CPU allocator's "
                     "bytes); MEMFIT_DEVICE")
    _args.add_gpu(est, help="a catalog card: rtx-4090, a100-80gb, h100-sxm, ... (default: the GPU torch sees, "
                  "else h100-sxm)")
    _args.add_batch(est, help="package.module:function returning a batch (for factory models)")
    tracing.add_argument("--full", action="store_true",
                         help="trace every block (and decode step), not two shallow traces scaled by depth: slower")
    batch.add_argument("--moe-routing", choices=("balanced", "worst"), default="balanced",
                       help="mixture of experts: balanced (default: tokens spread evenly) | worst (all on the same top-k)")
    batch.add_argument("--lengths", default=None, metavar="FILE",
                       help="per-example token counts (.txt, .npy, .jsonl): the worst micro-batch, padded to its longest")
    batch.add_argument("--packed", action="store_true",
                       help="pack documents into rows of --seq-len tokens, attention within each document (default off)")
    batch.add_argument("--max-batch-size", action="store_true",
                       help="instead: the largest micro-batch of this recipe that fits the budget (as memfit fit)")
    _args.add_json(est, help="print the report as JSON")
    output = _args.section(est, "output")
    output.add_argument("--html", default=None, metavar="FILE",
                        help="also draw the report as one interactive page; needs pip install 'memfit[pictures]'")
    output.add_argument("--png", default=None, metavar="FILE",
                        help="also draw the timeline and the module bars as a 1600x900 PNG")
    # every flag so far but the shared ones is a training step's: (dest, flag, default), checked by --generate
    _TRAINING[:] = [(a.dest, a.option_strings[0], a.default) for a in est._actions
                    if a.option_strings and a.dest not in _SHARED and a.dest != "help"]
    _generate_flags(est)


_TRAINING: list = []
# what --generate takes beside its own flags; every other flag of estimate is a training step's
_SHARED = {"model", "revision", "trust_remote_code", "batch_size", "precision", "full", "json", "budget",
           "moe_routing", "device", "gpu"}
# the generation's own flags: (dest, default)
_GENERATE = (("prompt_len", None), ("new_tokens", None), ("cache", None), ("weights", None), ("padding", False),
             ("logits_to_keep", None))
# mirrors generation.cache.CACHES and weights.WEIGHTS / DTYPES, written out so --help imports no torch
# (tests/test_generate_fast.py keeps them equal)
CACHE_HELP = "dynamic, static, quantized[:fp8|quanto|hqq]"
WEIGHT_CHOICES = ("auto", "int8", "nf4", "ao-int8wo", "ao-int8da8w")
GENERATE_PRECISIONS = ("bf16", "fp16", "fp32")


def _generate_flags(est) -> None:
    group = _args.section(est, "generation")
    group.add_argument("--generate", action="store_true",
                       help="a Hugging Face generate (greedy) instead of a training step: --batch-size is the prompts")
    group.add_argument("--prompt-len", type=_args.positive, default=None, metavar="N", help="with --generate: tokens per prompt")
    group.add_argument("--new-tokens", type=_args.positive, default=None, metavar="N",
                       help="with --generate: tokens generated after the prompt")
    group.add_argument("--cache", default=None, metavar="KIND", help=f"with --generate: the KV cache: {CACHE_HELP} (default dynamic)")
    group.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                       help="with --generate: linears in --precision (auto, default) | int8 | nf4 | ao-int8wo | "
                            "ao-int8da8w")
    group.add_argument("--padding", action="store_true",
                       help="with --generate: left-pad the shorter prompts of the batch (a 4-D mask each step)")
    group.add_argument("--logits-to-keep", type=int, default=None, metavar="N",
                       help="with --generate: prompt positions the prefill makes logits for (0: all; default: the last)")
    for action in est._actions:  # --precision also takes fp16 (a generation's half-precision weights)
        if action.dest == "precision" and action.choices is not None and "fp16" not in action.choices:
            action.choices = tuple(action.choices) + ("fp16",)


def run(args) -> int:
    if args.model is None:
        named = _args.trainer_config(args) if args.from_config is not None else None
        if named is None or named.model is None:
            raise MemfitError("name the model: memfit estimate MODEL (a catalog name, a Hub id or a config.json)"
                              + (f", or put model_name_or_path in {args.from_config}" if named is not None else ""))
        args.model = named.model
    if args.from_config is not None and (args.generate or args.max_batch_size):
        other = "--generate" if args.generate else "--max-batch-size"
        raise MemfitError(f"--from and {other} conflict: --from reads one training run's batch and recipe (not yet "
                          f"a search or a generation); drop one")
    if args.generate:
        return run_generate(args)
    given = [name for name, default in _GENERATE if getattr(args, name) != default]
    if given:
        raise MemfitError(f"--{given[0].replace('_', '-')} is for --generate (a Hugging Face generate): add --generate, "
                          f"or drop --{given[0].replace('_', '-')}")
    zero = str(getattr(args, "parallel", None) or "").startswith("zero")
    if args.precision == "fp16" and args.from_config is None and not zero:
        raise MemfitError("--precision fp16 is a --generate dtype, or DeepSpeed's fp16 section with --parallel "
                          "zero1-3: a training step of your own in half precision is fp16-mixed")
    if args.max_batch_size:
        if args.lengths is not None or args.packed:
            raise MemfitError("--max-batch-size does not take --lengths or --packed yet: estimate the batch sizes "
                              "you consider with --batch-size")
        if args.html is not None or args.png is not None:
            raise MemfitError("--max-batch-size does not draw pictures: find the batch size, then run "
                              "`memfit estimate --batch-size N --html FILE`")
        if args.batch_size is not None:
            raise MemfitError("--batch-size and --max-batch-size conflict: --max-batch-size finds it; drop --batch-size")
        from memfit.cli import fit

        args.device = "cuda" if args.gpu is not None else (args.device or "cuda")
        return fit.run(args)
    _check_pictures(args)

    from rich.console import Console

    from memfit.estimator.estimate import estimate, targeted
    from memfit.estimator.inputs import Data, Hardware
    from memfit.report.tables import report_view, verdict

    from memfit.hardware.gpus import target

    # --device-map places the model over GPUs: CUDA semantics whatever the default
    chosen = target("cuda" if args.device_map is not None and args.device is None else args.device, args.gpu)
    card, cuda = chosen.gpu, chosen.gpu is not None
    config = _args.trainer_config(args)
    recipe = _args.recipe_from_args(args, None if config is None else config.recipe)
    if config is not None:
        if args.gpus is None and args.nodes is None and (config.gpus or 1) * (config.nodes or 1) > 1:
            args.gpus, args.nodes = config.gpus, config.nodes  # accelerate's processes, Lightning's devices
        if args.seq_len is None:
            args.seq_len = config.seq_len
        if args.batch_size is None and recipe.micro_batch_size is not None:
            # the Trainer's per-device batch x accumulation x data-parallel processes
            ranks = (args.gpus or 1) * (args.nodes or 1) // (recipe.tp * recipe.pp * recipe.cp)
            args.batch_size = recipe.micro_batch_size * recipe.grad_accum_steps * max(1, ranks)
    with _args.progress(f"tracing {args.model} on fake tensors") as update:
        hardware = Hardware(device=chosen.device, gpu=card, budget=args.budget if cuda else None, gpus=args.gpus,
                            nodes=args.nodes)
        data = Data(batch_size=args.batch_size, seq_len=args.seq_len, lengths=args.lengths, packed=args.packed)
        report = estimate(_args.model_of(args), _args.import_spec(args.batch), hardware=hardware, data=data,
                          loss_fn=_args.import_spec(args.loss), recipe=recipe, steps=args.steps,
                          fast=False if args.full else None, moe_routing=args.moe_routing, progress=update,
                          device_map=args.device_map, max_memory=args.max_memory,
                          offload_folder=args.offload_folder, workload="forward" if args.forward_only else "train")
    report = targeted(chosen, report)
    if config is not None:
        report = dataclasses.replace(report, notes=report.notes + _from_notes(config, args.model))
    if args.json:
        data = report.to_dict()
        if args.budget is not None or report.verdict is not None:
            data["budget"] = verdict(report, args.budget)
        print(json.dumps(data, indent=2))
    else:
        Console().print(report_view(report, args.model, args.budget, recipe=recipe))
    _write_pictures(args, report)
    return 0


def _from_notes(config, model) -> list[str]:
    """What ``--from`` read, for the report's notes."""
    import os

    name = os.path.basename(config.path)
    neutral = [key for key, _, how in config.read if how.startswith("no effect")]
    defaults = [f"{key}={value}" for key, value, how in config.read if how.endswith("default")]
    notes = [f"read {name} ({config.kind}): {config.recipe.describe()}"
             + (f"; the Trainer's default {', '.join(defaults)}" if defaults else "")
             + (f"; {len(neutral)} setting(s) with no effect on device memory ({', '.join(neutral[:4])}"
                + (", ..." if len(neutral) > 4 else "") + ")" if neutral else "")]
    if config.model is not None and config.model != model:
        notes.append(f"{name} names the model {config.model}; estimated for {model}, as the command says")
    return notes


def run_generate(args) -> int:
    """``--generate``: ``estimate_generate`` (its fast path unless --full), the report as a table or JSON."""
    _check_generate_flags(args)

    from rich.console import Console

    from memfit.generation import estimate_generate
    from memfit.hardware.gpus import target
    from memfit.report.tables import report_view, verdict

    chosen = target(args.device, args.gpu)
    with _args.progress(f"tracing {args.model}'s generate on fake tensors") as update:
        report = estimate_generate(_args.model_of(args), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                   batch_size=args.batch_size or 1, precision=args.precision,
                                   cache=args.cache or "dynamic", weights=args.weights or "auto",
                                   padding=args.padding, logits_to_keep=args.logits_to_keep,
                                   moe_routing=args.moe_routing, fast=False if args.full else None, progress=update,
                                   device=chosen.device, gpu=chosen.gpu,
                                   budget=args.budget if chosen.gpu is not None else None)
    report = dataclasses.replace(report, settings={**report.settings, "target": chosen.how})
    if args.json:
        data = report.to_dict()
        if args.budget is not None or report.verdict is not None:
            data["budget"] = verdict(report, args.budget)
        print(json.dumps(data, indent=2))
    else:
        Console().print(report_view(report, args.model, args.budget))
    return 0


def _check_generate_flags(args) -> None:
    """One line for a training step's flag given with --generate, or a generation's missing."""
    for name in ("prompt_len", "new_tokens"):
        if getattr(args, name) is None:
            raise MemfitError(f"--generate needs --{name.replace('_', '-')}: the prompt's tokens (--prompt-len) and "
                              "the tokens to generate (--new-tokens)")
    if args.precision in ("bf16-mixed", "fp16-mixed"):
        raise MemfitError(f"--precision {args.precision} is a training recipe: a generation runs in one dtype, "
                          f"{', '.join(GENERATE_PRECISIONS)}")
    for name, flag, default in _TRAINING:
        if getattr(args, name, default) != default:
            flag = "--" + name.replace("_", "-")
            raise MemfitError(f"{flag} and --generate conflict: {flag} is for a training step; drop it, or drop "
                              "--generate")


def _check_pictures(args) -> None:
    """Refuse --html/--png files that could not be written, before the estimate runs."""
    if args.html is not None or args.png is not None:
        from memfit.report.pictures import require

        require()
    for flag, path in (("--html", args.html), ("--png", args.png)):
        _args.check_file(flag, path)


def _write_pictures(args, report) -> None:
    """The pictures, after the estimate; "wrote FILE" on stderr so that --json's stdout stays JSON."""
    if args.html is None and args.png is None:
        return
    from memfit.report.pictures import write_html, write_png

    title = f"memfit estimate {args.model}"
    for path, write in ((args.html, write_html), (args.png, write_png)):
        if path is not None:
            print(f"wrote {write(report, path, title=title)}", file=sys.stderr)
