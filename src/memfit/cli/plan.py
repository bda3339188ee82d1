"""``memfit plan``: the fastest recipe that fits a budget, and why."""

from __future__ import annotations

import json
import math
import os
import sys

from memfit.cli import _args
from memfit.errors import MemfitError


def build(pl) -> None:
    pl.usage = "%(prog)s MODEL [--gpu CARD | --budget SIZE] [flags]"
    _args.add_model(pl)
    _args.add_loss(pl)
    _args.add_gpu(pl, help="the card to plan for: its memory the budget, its speeds the cost model (default h100-sxm)")
    _args.add_budget(pl)
    _args.add_device(pl, "cuda", help="plan for a GPU: cuda (default; speeds of --gpu or h100-sxm) | this cpu")
    _args.add_seq_len(pl)
    _args.section(pl, "batch").add_argument(
        "--batch-size", "--global-batch-size", dest="global_batch_size", type=_args.positive, metavar="N",
        default=None, help="examples per step (default 8), as micro-batch x accumulation; --global-batch-size is "
        "the same flag")
    _args.add_batch(pl, help="package.module:function returning the global batch (factory models; split along dim 0)")
    planning = _args.section(pl, "planning")
    planning.add_argument("--allow", default="", metavar="NAMES",
                          help=f"techniques that change the math, allowed by name: {','.join(_args.allowable())}")
    _args.section(pl, "optimizer").add_argument("--optimizer", default="adamw", metavar="NAME",
                                                help="the optimizer training uses (default adamw)")
    _args.add_world(pl, help="GPUs per node (default 1): plan searches data parallel and FSDP2 x TP over them")
    _args.section(pl, "parallel").add_argument(
        "--engine", default=None, metavar="NAME[,NAME]",
        help="across GPUs: torch (DDP, FSDP2; default), deepspeed (ZeRO 1-3; --emit deepspeed's default), both")
    _args.add_out(pl, help="write the chosen recipe to this .yaml/.json file")
    output = _args.section(pl, "output")
    output.add_argument("--emit", default=None, metavar="TOOL[,TOOL]",
                        help="the recipe in your trainer's terms: hf-trainer, accelerate, lightning, pytorch, "
                             "deepspeed or all")
    output.add_argument("--emit-dir", default=None, metavar="DIR",
                        help="write the --emit files into DIR (default: print them)")
    _args.add_json(pl, help="print the plans as JSON")


def run(args) -> int:
    from rich.console import Console

    from memfit.estimator.inputs import gather
    from memfit.planner.plan import NothingFits, plan
    from memfit.report.tables import plan_view

    _args.check_gpu_device(args)
    if args.out is not None:
        _args.check_out(args.out)
    tools = _tools(args.emit)
    if args.emit_dir is not None and not tools:
        raise MemfitError("--emit-dir names where --emit's files go: add --emit TOOL (or all)")
    batch = _args.import_spec(args.batch)
    gbs = args.global_batch_size
    if gbs is None and batch is None:  # 8, or across GPUs the smallest multiple of 8 that gives each one a row
        gbs = math.lcm(8, (args.gpus or 1) * (args.nodes or 1)) if isinstance(args.gpus, int) else 8
    with _args.progress(f"planning {args.model}") as update:
        try:
            # gather names the flag's field in an error (global_batch_size, as plan()'s keyword), not Data's batch_size
            hardware, data = gather(names={"batch_size": "global_batch_size"}, batch_size=gbs, seq_len=args.seq_len,
                                    gpu=args.gpu, device=args.device, budget=args.budget, gpus=args.gpus,
                                    nodes=args.nodes)
            plans = plan(_args.model_of(args), batch, hardware=hardware, data=data,
                         allow=args.allow, optimizer=args.optimizer, loss_fn=_args.import_spec(args.loss),
                         progress=update, fixed=_within(tools, args), engines=_engines(args.engine, tools))
        except NothingFits as err:
            if args.json:
                smallest = err.smallest.to_dict() if err.smallest is not None else None
                print(json.dumps({"fits": False, "message": str(err), "smallest": smallest}, indent=2))
            else:
                print(f"memfit: {err}", file=sys.stderr)
            return 1
    if args.out:
        try:
            plans.best.recipe.save(args.out)
        except OSError as err:
            raise MemfitError(f"cannot write --out {args.out}: {err.strerror or err}") from None
    emitted = _emit(plans.best.recipe, tools, args)
    if args.json:
        print(json.dumps({"fits": True, **plans.to_dict()} | ({"emitted": [e.to_dict() for e in emitted]}
                                                               if emitted else {}), indent=2))
    else:
        console = Console()
        console.print(plan_view(plans, args.model, args.out))
        for e in emitted:
            where = f" -> {os.path.join(args.emit_dir, e.filename)}" if args.emit_dir else ""
            console.print(f"\n[bold]{e.tool}[/bold] ({e.filename}){where}", highlight=False)
            if not args.emit_dir:
                console.print(e.text.rstrip(), markup=False, highlight=False)
            for note in e.notes:
                console.print(f"  note: {note}", markup=False, highlight=False)
    return 0


def _tools(value) -> list:
    if value is None:
        return []
    from memfit.trainers.emit import TOOLS

    # all: every trainer's file; a ds_config.json is asked for by name (it is a ZeRO recipe's: --parallel zero1-3)
    tools = ([t for t in TOOLS if t != "deepspeed"] if value.strip() == "all"
             else [t.strip() for t in value.split(",") if t.strip()])
    bad = [t for t in tools if t not in TOOLS]
    if bad or not tools:
        raise MemfitError(f"--emit {bad[0] if bad else value!r} is not a tool memfit writes: use "
                          f"{', '.join(TOOLS)} or all (comma-separated)")
    return tools


def _engines(value, tools: list) -> tuple:
    """--engine's names; without it, DeepSpeed's ZeRO alone where --emit asks for a ds_config.json (it runs only a
    ZeRO recipe), PyTorch's engines otherwise."""
    from memfit.planner.plan import check_engines

    if value is None:
        return ("deepspeed",) if "deepspeed" in tools else ("torch",)
    try:
        return check_engines(value)
    except MemfitError:
        raise MemfitError(f"--engine {value!r} is not a data-parallel engine: use torch, deepspeed or "
                          "torch,deepspeed") from None


def _within(tools: list, args):
    """With --emit, a one-GPU plan searches only what the named trainers can say. The multi-GPU search takes no
    fixed fields: what its recipe holds that a trainer cannot say (TP, PP, CP, EP) is one of the file's notes."""
    if not tools or args.gpus is not None or args.nodes is not None:  # --gpus 1 too: the search across GPUs
        return None
    from memfit.trainers.emit import within

    return within(tools) or None


def _emit(recipe, tools: list, args) -> list:
    from memfit.trainers.emit import emit

    emitted = [emit(recipe, tool, gpus=args.gpus or 1, nodes=args.nodes or 1, seq_len=args.seq_len,
                    model=args.model if isinstance(args.model, str) else None) for tool in tools]
    if args.emit_dir:
        try:
            os.makedirs(args.emit_dir, exist_ok=True)
            for e in emitted:
                with open(os.path.join(args.emit_dir, e.filename), "w", encoding="utf-8") as f:
                    f.write(e.text)
        except OSError as err:
            raise MemfitError(f"cannot write --emit-dir {args.emit_dir}: {err.strerror or err}") from None
    return emitted
