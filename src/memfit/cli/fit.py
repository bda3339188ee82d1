"""``memfit fit``: the largest micro-batch of a recipe that fits a card or a budget."""

from __future__ import annotations

import json
import sys

from memfit.cli import _args
from memfit.errors import MemfitError


def build(fit) -> None:
    fit.usage = "%(prog)s MODEL [--gpu CARD | --budget SIZE] [flags]"
    _args.add_model(fit)
    _args.add_loss(fit)
    _args.add_gpu(fit, help="the card: its memory the budget, its CUDA semantics (default: the GPU torch sees, "
                  "else h100-sxm)")
    _args.add_budget(fit)
    _args.add_device(fit, "cuda", help="cuda (default: --gpu's semantics) | cpu (the CPU allocator's bytes)")
    _args.add_seq_len(fit)
    _args.add_recipe(fit)
    _args.add_world(fit)
    _args.recipe_flags(fit)
    _args.add_batch(fit, help="package.module:function returning an example batch (factory models; grown along dim 0)")
    _args.add_out(fit, help="write the recipe with the micro-batch found to this .yaml/.json file")
    _args.add_json(fit, help="print the answer as JSON")


def run(args) -> int:
    """Also ``memfit estimate --max-batch-size`` (whose args have no ``--out``)."""
    from rich.console import Console

    from memfit.estimator.inputs import Data, Hardware
    from memfit.planner.fit import NoBatchFits, fit
    from memfit.report.tables import fit_view

    recipe = _args.recipe_from_args(args)
    if recipe.micro_batch_size is not None:
        raise MemfitError("fit searches the micro-batch size: drop --micro-batch-size (or micro_batch_size in --recipe)")
    _args.check_gpu_device(args)
    out = getattr(args, "out", None)
    if out is not None:
        _args.check_out(out)
    with _args.progress(f"fitting {args.model}") as update:
        try:
            hardware = Hardware(gpu=args.gpu, budget=args.budget, device=args.device, gpus=getattr(args, "gpus", None),
                                nodes=getattr(args, "nodes", None))
            found = fit(_args.model_of(args), _args.import_spec(args.batch), hardware=hardware,
                        data=Data(seq_len=args.seq_len), recipe=recipe, loss_fn=_args.import_spec(args.loss),
                        progress=update)
        except NoBatchFits as err:
            if args.json:
                print(json.dumps({"fits": False, "message": str(err), "needed_bytes": err.needed_bytes,
                                  "budget_bytes": err.budget_bytes}, indent=2))
            else:
                print(f"memfit: {err}", file=sys.stderr)
            return 1
    if out:
        found.recipe.save(out)
    if args.json:
        print(json.dumps(found.to_dict(), indent=2))
    else:
        Console().print(fit_view(found, args.model))
        if out:
            Console().print(f"recipe written to {out} (memfit estimate {args.model} --recipe {out})", markup=False,
                            highlight=False)
    return 0
