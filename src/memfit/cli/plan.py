"""``memfit plan``: the fastest recipe that fits a budget, and why."""

from __future__ import annotations

import json
import math
import sys

from memfit.cli import _args
from memfit.errors import MemfitError


def build(pl) -> None:
    _args.add_model(pl)
    _args.add_gpu(pl, help="the card to plan for (rtx-4090, a100-80gb, ...): its memory is "
                  "the budget and its speeds the cost model; see `memfit gpus`")
    _args.add_budget(pl)
    _args.add_device(pl, "cuda", help="plan for a GPU (cuda, default; speeds of --gpu or h100-sxm) or for this CPU")
    _args.add_seq_len(pl)
    pl.add_argument("--batch-size", "--global-batch-size", dest="global_batch_size", type=_args.positive, metavar="N",
                    default=None, help="examples per optimizer step, split into micro-batch x accumulation, as "
                    "estimate's --batch-size (default 8, across GPUs a multiple of 8 that gives each one a row; with --batch, the batch's rows); --global-batch-size "
                    "is the same flag")
    _args.add_batch(pl, help="package.module:function returning the global batch (for "
                    "factory models; dim 0 is split into micro-batches)")
    _args.add_loss(pl)
    pl.add_argument("--allow", default="", help="techniques that change the math, allowed by name: "
                    f"{', '.join(_args.allowable())} (comma-separated)")
    pl.add_argument("--optimizer", default="adamw", help="the optimizer training uses (default adamw)")
    _args.add_world(pl)
    _args.add_out(pl, help="write the chosen recipe to this .yaml/.json file")
    _args.add_json(pl, help="print the plans as JSON")


def run(args) -> int:
    from rich.console import Console

    from memfit.planner.plan import NothingFits, plan
    from memfit.report.tables import plan_view

    _args.check_gpu_device(args)
    if args.out is not None:
        _args.check_out(args.out)
    batch = _args.import_spec(args.batch)
    gbs = args.global_batch_size
    if gbs is None and batch is None:  # 8, or across GPUs the smallest multiple of 8 that gives each one a row
        gbs = math.lcm(8, (args.gpus or 1) * (args.nodes or 1)) if isinstance(args.gpus, int) else 8
    with _args.progress(f"planning {args.model}") as update:
        try:
            plans = plan(_args.model_of(args), batch, budget=args.budget, gpu=args.gpu, device=args.device,
                         global_batch_size=gbs, seq_len=args.seq_len, allow=args.allow,
                         optimizer=args.optimizer, loss_fn=_args.import_spec(args.loss), progress=update,
                         gpus=args.gpus, nodes=args.nodes)
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
    if args.json:
        print(json.dumps({"fits": True, **plans.to_dict()}, indent=2))
    else:
        Console().print(plan_view(plans, args.model, args.out))
    return 0
