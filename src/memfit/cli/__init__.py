"""The ``memfit`` command: thin argument parsing over the public API.

Every command prints a human table by default and JSON with ``--json``. Bad input is one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings

from memfit.errors import MemfitError
from memfit.units import format_size, parse_size

__all__ = ["main"]


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except MemfitError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {MemfitError(message)} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memfit", description="Make PyTorch training fit in the GPU memory you have.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    est = sub.add_parser("estimate", help="memory of one training step, on fake tensors (no GPU, no memory)")
    est.add_argument("model", help="catalog name (see `memfit models`), a config.json path, or package.module:function")
    est.add_argument("--batch-size", type=_positive, default=None,
                     help="examples per optimizer step (default 1; with --micro-batch-size it must equal "
                          "micro-batch x --grad-accum-steps)")
    est.add_argument("--seq-len", type=_positive, default=None, help="tokens per example (default: the model's, at most 2048)")
    est.add_argument("--recipe", default=None, help="a recipe .yaml/.json; flags below override its fields")
    _recipe_flags(est)
    est.add_argument("--steps", type=_positive, default=2, help="steps to run; step 2 has optimizer state (default 2)")
    est.add_argument("--budget", type=_size, default=None,
                     help="bytes available, e.g. 24GiB, 24GB, 80G; on a GPU the whole process's share of the card, "
                     "as set_per_process_memory_fraction enforces it (default: the whole card)")
    est.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="whose semantics to follow: cpu (default), or cuda (allocated, reserved, context)")
    est.add_argument("--gpu", default=None, help="a GPU of the catalog (rtx-4090, a100-80gb, h100-sxm, ...): "
                     "CUDA semantics of that card and its memory as the budget; see `memfit gpus`")
    est.add_argument("--batch", default=None, help="package.module:function returning a batch (for factory models)")
    est.add_argument("--loss", default=None, help="package.module:function(model, batch) -> scalar loss")
    est.add_argument("--full", action="store_true", help="trace every block instead of scaling two shallow traces by depth")
    est.add_argument("--moe-routing", choices=("balanced", "worst"), default="balanced",
                     help="mixture-of-experts only: tokens spread evenly over the experts (default), or all on the "
                          "same top-k experts (worst case for CPU bf16 kernel scratch)")
    est.add_argument("--max-batch-size", action="store_true",
                     help="instead: the largest micro-batch of this recipe that fits the budget (as `memfit fit`)")
    est.add_argument("--json", action="store_true", help="print the report as JSON")
    _fit_parser(sub)
    pl = sub.add_parser("plan", help="the fastest recipe that fits a budget, and why")
    pl.add_argument("model", help="catalog name (see `memfit models`), a config.json path, or package.module:function")
    pl.add_argument("--gpu", default=None, help="the card to plan for (rtx-4090, a100-80gb, ...): its memory is "
                    "the budget and its speeds the cost model; see `memfit gpus`")
    pl.add_argument("--budget", type=_size, default=None, help="bytes available, e.g. 24GiB (default: the --gpu's memory)")
    pl.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                    help="plan for a GPU (cuda, default; speeds of --gpu or h100-sxm) or for this CPU")
    pl.add_argument("--seq-len", type=_positive, default=None, help="tokens per example (default: the model's, at most 2048)")
    pl.add_argument("--global-batch-size", type=_positive, default=None,
                    help="examples per optimizer step, split into micro-batch x accumulation "
                    "(default 8; with --batch, the batch's rows)")
    pl.add_argument("--batch", default=None, help="package.module:function returning the global batch (for "
                    "factory models; dim 0 is split into micro-batches)")
    pl.add_argument("--loss", default=None, help="package.module:function(model, batch) -> scalar loss")
    pl.add_argument("--allow", default="", help="techniques that change the math, allowed by name: "
                    "lora, qlora, adamw8bit, paged_adamw8bit, bf16 (comma-separated)")
    pl.add_argument("--optimizer", default="adamw", help="the optimizer training uses (default adamw)")
    pl.add_argument("--out", default=None, help="write the chosen recipe to this .yaml/.json file")
    pl.add_argument("--json", action="store_true", help="print the plans as JSON")
    models = sub.add_parser("models", help="list the built-in model catalog")
    models.add_argument("--json", action="store_true", help="print the list as JSON")
    gpus = sub.add_parser("gpus", help="list the GPU catalog")
    gpus.add_argument("--json", action="store_true", help="print the list as JSON")
    return parser


def _fit_parser(sub) -> None:
    fit = sub.add_parser("fit", help="the largest micro-batch of a recipe that fits a card or a budget")
    fit.add_argument("model", help="catalog name (see `memfit models`), a config.json path, or package.module:function")
    fit.add_argument("--gpu", default=None, help="the card (rtx-4090, a100-80gb, ...): its memory is the budget and "
                     "its CUDA semantics are followed; see `memfit gpus`")
    fit.add_argument("--budget", type=_size, default=None, help="bytes available, e.g. 24GiB (default: the --gpu's memory)")
    fit.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                     help="follow CUDA semantics (default; h100-sxm's without --gpu) or the CPU's")
    fit.add_argument("--seq-len", type=_positive, default=None, help="tokens per example (default: the model's, at most 2048)")
    fit.add_argument("--recipe", default=None, help="a recipe .yaml/.json; flags below override its fields")
    _recipe_flags(fit)
    fit.add_argument("--batch", default=None, help="package.module:function returning an example batch (for factory "
                     "models; grown along dim 0 to each size tried)")
    fit.add_argument("--loss", default=None, help="package.module:function(model, batch) -> scalar loss")
    fit.add_argument("--out", default=None, help="write the recipe with the micro-batch found to this .yaml/.json file")
    fit.add_argument("--json", action="store_true", help="print the answer as JSON")


def _recipe_flags(parser) -> None:
    """One flag per Recipe field, from the techniques' declarations; None means "not given", so a
    --recipe file's value stands."""
    from memfit.techniques.registry import fields

    types = {"int": int, "count": _positive, "optional-count": _positive}
    for field in fields():
        if field.kind == "bool":
            parser.add_argument(field.flag, action="store_true", default=None, help=field.help)
        else:
            choices = field.choices if field.choices and field.flag_choices else None
            parser.add_argument(field.flag, type=types.get(field.kind), choices=choices, default=None,
                                help=field.help)


def _recipe(args):
    from memfit.techniques.recipe import Recipe

    base = Recipe.load(args.recipe) if args.recipe else Recipe()
    changes = {name: getattr(args, name) for name in Recipe.fields() if getattr(args, name, None) is not None}
    return base.replace(**changes) if changes else base


def _import(spec: str | None):
    from memfit.models.check import import_object

    return None if spec is None else import_object(spec)


def _estimate(args) -> int:
    from rich.console import Console

    from memfit.estimator.estimate import estimate
    from memfit.report.tables import report_view, verdict

    if args.max_batch_size:
        if args.batch_size is not None:
            raise MemfitError("--batch-size and --max-batch-size conflict: --max-batch-size finds it; drop --batch-size")
        args.device = "cuda" if args.gpu is not None else args.device
        return _fit(args)
    card = None
    if args.gpu is not None:
        from memfit.hardware.gpus import gpu

        card = gpu(args.gpu)
    cuda = card is not None or args.device == "cuda"  # the budget is the allocator's limit on the card
    with _progress(f"tracing {args.model} on fake tensors") as update:
        report = estimate(args.model, _import(args.batch), loss_fn=_import(args.loss), recipe=_recipe(args),
                          steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                          fast=False if args.full else None, device="cuda" if cuda else args.device, gpu=card,
                          moe_routing=args.moe_routing, budget=args.budget if cuda else None, progress=update)
    if args.json:
        data = report.to_dict()
        if args.budget is not None or report.verdict is not None:
            data["budget"] = verdict(report, args.budget)
        print(json.dumps(data, indent=2))
    else:
        Console().print(report_view(report, args.model, args.budget))
    return 0


@contextlib.contextmanager
def _progress(description: str):
    """A bar on stderr (``--json`` output stays clean): a spinner and the elapsed time, and the count
    done of the total once the work reports one through the ``update(done, total)`` this yields."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as shown:
        task = shown.add_task(description, total=None)
        yield lambda done, total: shown.update(task, completed=done, total=total)


def _fit(args) -> int:
    from rich.console import Console

    from memfit.planner.fit import NoBatchFits, fit
    from memfit.report.tables import fit_view

    recipe = _recipe(args)
    if recipe.micro_batch_size is not None:
        raise MemfitError("fit searches the micro-batch size: drop --micro-batch-size (or micro_batch_size in --recipe)")
    if args.device == "cpu" and args.gpu is not None:
        raise MemfitError("--gpu and --device cpu conflict: drop one")
    if getattr(args, "out", None) is not None:
        _check_out(args.out)
    with _progress(f"fitting {args.model}") as update:
        try:
            found = fit(args.model, _import(args.batch), gpu=args.gpu, budget=args.budget, recipe=recipe,
                        seq_len=args.seq_len, loss_fn=_import(args.loss), device=args.device, progress=update)
        except NoBatchFits as err:
            if args.json:
                print(json.dumps({"fits": False, "message": str(err), "needed_bytes": err.needed_bytes,
                                  "budget_bytes": err.budget_bytes}, indent=2))
            else:
                print(f"memfit: {err}", file=sys.stderr)
            return 1
    if getattr(args, "out", None):
        found.recipe.save(args.out)
    if args.json:
        print(json.dumps(found.to_dict(), indent=2))
    else:
        Console().print(fit_view(found, args.model))
        if getattr(args, "out", None):
            Console().print(f"recipe written to {args.out} (memfit estimate {args.model} --recipe {args.out})")
    return 0


def _plan(args) -> int:
    from rich.console import Console

    from memfit.planner.plan import NothingFits, plan
    from memfit.report.tables import plan_view

    if args.device == "cpu" and args.gpu is not None:
        raise MemfitError("--gpu and --device cpu conflict: drop one")
    if args.out is not None:
        _check_out(args.out)
    batch = _import(args.batch)
    gbs = args.global_batch_size if args.global_batch_size is not None or batch is not None else 8
    with _progress(f"planning {args.model}") as update:
        try:
            plans = plan(args.model, batch, budget=args.budget, gpu=args.gpu, device=args.device,
                         global_batch_size=gbs, seq_len=args.seq_len, allow=args.allow,
                         optimizer=args.optimizer, loss_fn=_import(args.loss), progress=update)
        except NothingFits as err:
            if args.json:
                print(json.dumps({"fits": False, "message": str(err), "smallest": err.smallest.to_dict()}, indent=2))
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


def _check_out(path: str) -> None:
    """Refuse an --out the recipe could not be written to, before the plan runs (minutes)."""
    import os

    folder = os.path.dirname(os.path.abspath(path)) if path else ""
    if not path.endswith((".yaml", ".yml", ".json")):
        raise MemfitError(f"--out {path!r} must end in .yaml, .yml or .json: name the recipe file")
    if os.path.isdir(path):
        raise MemfitError(f"--out {path} is a directory: name a .yaml or .json file in it")
    if not os.path.isdir(folder):
        raise MemfitError(f"--out {path}: the directory {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise MemfitError(f"--out {path}: cannot write to {folder}; choose another directory")


def _gpus(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from memfit.hardware.gpus import CATALOG

    if args.json:
        print(json.dumps([g.to_dict() for g in CATALOG.values()], indent=2))
        return 0
    table = Table(title="GPU catalog (figures and sources in memfit/hardware/gpus.py)", title_justify="left")
    for column in ("name", "memory", "compute", "bf16", "bf16 dense", "memory bw", "host link"):
        table.add_column(column, justify="left" if column in ("name", "host link") else "right")
    for g in CATALOG.values():
        table.add_row(g.name, format_size(g.memory_bytes), "%d.%d" % g.compute_capability, "yes" if g.bf16 else "no",
                      f"{g.bf16_flops / 1e12:.0f} TFLOPS" if g.bf16 else "-", f"{g.memory_bandwidth / 1e12:.2f} TB/s",
                      f"{g.host_link} {g.host_link_bandwidth / 1e9:.0f} GB/s")
    Console().print(table)
    return 0


def _models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from memfit.models.catalog import CATALOG

    if args.json:
        print(json.dumps({k: {"model_type": v.model_type, "task": v.task, **v.config} for k, v in CATALOG.items()}, indent=2))
        return 0
    table = Table("name", "type", "task")
    for name, entry in CATALOG.items():
        table.add_row(name, entry.model_type, entry.task)
    Console().print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_transformers()
    try:
        with warnings.catch_warnings():
            # peft, bitsandbytes and transformers warn about choices memfit makes on purpose
            # (fan_in_fan_out for GPT-2's Conv1D, CPU kernels) or about the user's config's
            # spelling (deprecated keys); on stderr they would bury the table or the error line
            warnings.filterwarnings("ignore", module=r"(peft|bitsandbytes|transformers)(\.|$)")
            return {"estimate": _estimate, "fit": _fit, "plan": _plan, "models": _models,
                    "gpus": _gpus}[args.command](args)
    except MemfitError as err:
        print(f"memfit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `memfit ... | head`
        sys.stderr.close()
        return 0


def _quiet_transformers() -> None:
    """Config warnings from transformers (unused token ids, loss type) are noise in a table; so are
    torchao's notes, at import, about CUDA kernels a CPU machine cannot load (transformers imports
    torchao when it is installed), and torch's deprecation note on torchao's pytree registrations, and bitsandbytes' note that an optional
CPU kernel package is missing."""
    import logging as std_logging

    for name in ("torchao", "torch.utils._pytree", "bitsandbytes"):
        std_logging.getLogger(name).setLevel(std_logging.ERROR)
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.set_verbosity_error()


if __name__ == "__main__":
    sys.exit(main())
