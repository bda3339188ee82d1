"""``memfit fit``: the largest micro-batch of a recipe that fits a card or a budget; with ``--longest``, the
longest sequence at a micro-batch (``planner/longest.py``)."""

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
    longest = _args.section(fit, "batch")
    longest.add_argument("--longest", action="store_true",
                         help="the longest sequence that fits at --micro-batch-size (default 1), not the largest batch")
    longest.add_argument("--seq-multiple", type=_args.positive, default=1, metavar="N",
                         help="with --longest: search lengths in multiples of N tokens (default 1)")
    _args.add_out(fit, help="write the recipe with the micro-batch found to this .yaml/.json file")
    _args.add_json(fit, help="print the answer as JSON")


def run(args) -> int:
    """Also ``memfit estimate --max-batch-size`` (whose args have no ``--out``)."""
    from rich.console import Console

    from memfit.estimator.inputs import Data, Hardware
    from memfit.planner.fit import NoBatchFits, fit
    from memfit.report.tables import fit_view

    recipe = _args.recipe_from_args(args)
    if getattr(args, "longest", False):
        return _longest(args, recipe)
    if getattr(args, "seq_multiple", 1) != 1:
        raise MemfitError("--seq-multiple goes with --longest (the lengths it searches): add --longest or drop it")
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
            return _nothing_fits(err, args)
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


def _longest(args, recipe) -> int:
    """``memfit fit --longest``: the longest sequence at the micro-batch given (``planner/longest.py``)."""
    from rich.console import Console

    from memfit.estimator.inputs import Hardware
    from memfit.planner.longest import NoLengthFits, longest
    from memfit.report.tables import longest_view

    for flag, given in (("--seq-len", args.seq_len), ("--batch", args.batch), ("--out", getattr(args, "out", None))):
        if given is not None:
            raise MemfitError(f"--longest searches the sequence length of a config model's own batch: drop {flag}")
    _args.check_gpu_device(args)
    rows = recipe.micro_batch_size or 1
    with _args.progress(f"finding the longest sequence of {args.model}") as update:
        try:
            hardware = Hardware(gpu=args.gpu, budget=args.budget, device=args.device, gpus=getattr(args, "gpus", None),
                                nodes=getattr(args, "nodes", None))
            found = longest(_args.model_of(args), hardware=hardware, recipe=recipe.replace(micro_batch_size=None),
                            loss_fn=_args.import_spec(args.loss), micro_batch_size=rows, multiple=args.seq_multiple,
                            progress=update)
        except NoLengthFits as err:
            return _nothing_fits(err, args)
    if args.json:
        print(json.dumps(found.to_dict(), indent=2))
    else:
        Console().print(longest_view(found, args.model))
    return 0


def _nothing_fits(err, args) -> int:
    """``NoBatchFits`` / ``NoLengthFits``: the one line (or ``--json``'s object), exit 1."""
    if args.json:
        print(json.dumps({"fits": False, "message": str(err), "needed_bytes": err.needed_bytes,
                          "budget_bytes": err.budget_bytes}, indent=2))
    else:
        print(f"memfit: {err}", file=sys.stderr)
    return 1
