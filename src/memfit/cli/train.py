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
    train.usage = "%(prog)s MODEL --data FILE [flags]"
    _args.add_model(train)
    data = _args.section(train, "data")
    data.add_argument("--data", default=None, metavar="PATH",
                      help="a nanoGPT .bin token file, a .jsonl (text or input_ids) or a saved datasets directory")
    data.add_argument("--tokenizer", default=None, metavar="DIR", help="a local tokenizer directory (for .jsonl text)")
    data.add_argument("--dtype", default=None, help="the token file's dtype (default uint16)")
    data.add_argument("--packed", action="store_true", default=None, help="pack documents into rows of --seq-len "
                      "tokens, attention within each (causal LMs)")
    data.add_argument("--workers", type=int, default=None, metavar="N", help="DataLoader worker processes (default 0)")
    recipe = _args.section(train, "recipe")
    recipe.add_argument("--config", default=None, metavar="FILE", help="a YAML file of these flags' values (flags win)")
    recipe.add_argument("--recipe", default=None, metavar="FILE|auto",
                        help="a recipe .yaml/.json (flags override it), or auto: plan one first (the default with a "
                             "card)")
    _args.add_seq_len(train)
    batch = _args.section(train, "batch")
    batch.add_argument("--global-batch-size", type=_args.positive, default=None, metavar="N",
                       help="examples per optimizer step")
    batch.add_argument("--global-tokens", type=_args.positive, default=None, metavar="N",
                       help="tokens per optimizer step (instead of --global-batch-size)")
    run = _args.section(train, "run")
    run.add_argument("--steps", type=_args.positive, default=None, metavar="N", help="optimizer steps to run in total")
    run.add_argument("--epochs", type=float, default=None, metavar="X", help="passes over the data (instead of --steps)")
    run.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-4)")
    run.add_argument("--schedule", choices=("constant", "cosine"), default=None, help="after warmup (default cosine)")
    run.add_argument("--warmup", type=int, default=None, metavar="N", help="linear warmup steps (default 0)")
    run.add_argument("--seed", type=int, default=None, help="data order and initialisation (default 0)")
    _args.add_budget(train, help="memory the run may use, e.g. 24GiB: CPU a virtual cap, CUDA the process's "
                     "memory fraction")
    _args.section(train, "card").add_argument("--device", choices=("cpu", "cuda", "mps"), default=None,
                                              help="where to train (default: cuda if available)")
    _args.add_gpu(train, help="on CUDA, the catalog card the estimates follow (default h100-sxm); its memory the "
                  "budget")
    checkpoints = _args.section(train, "checkpoints")
    checkpoints.add_argument("--out-dir", default=None, metavar="DIR",
                             help="checkpoints and metrics.jsonl (default memfit-run)")
    checkpoints.add_argument("--no-resume", dest="resume", action="store_false", default=None,
                             help="start fresh even if --out-dir has checkpoints (default: resume)")
    checkpoints.add_argument("--checkpoint-every", type=_args.positive, default=None, metavar="N",
                             help="steps between checkpoints (default 50; always at the end)")
    checkpoints.add_argument("--keep", type=_args.positive, default=None, metavar="N", help="checkpoints kept (default 2)")
    checkpoints.add_argument("--tensorboard", dest="tensorboard", action="store_true", default=None,
                             help="require TensorBoard scalars in --out-dir/tensorboard (default: when installed)")
    checkpoints.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                             help="no TensorBoard scalars even if installed")
    planning = _args.section(train, "planning")
    planning.add_argument("--allow", default="", metavar="NAMES", help="when it plans: techniques that change the "
                          f"math: {','.join(_args.allowable())}")
    planning.add_argument("--no-plan", action="store_true", help="do not plan: the default recipe and the flags "
                          "given (micro-batches still sized)")
    planning.add_argument("--no-calibrate", action="store_true", help="trust the plan's fastest instead of timing "
                          "the top few here first (<= 20 s)")
    planning.add_argument("--replan", action="store_true", help="plan again even if this plan is stored "
                          "($MEMFIT_CACHE or ~/.cache/memfit)")
    launch = _args.section(train, "launch")
    launch.add_argument("--nproc-per-node", type=_args.positive, default=None, metavar="N",
                        help="processes on this machine, one per GPU (on the CPU: gloo)")
    launch.add_argument("--nnodes", type=_args.positive, default=None, metavar="N", help="machines (default 1)")
    launch.add_argument("--node-rank", type=int, default=None, metavar="N", help="this machine's index (0 .. nnodes-1)")
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="host:port every machine reaches (several machines)")
    launch.add_argument("--max-restarts", type=int, default=None, metavar="N", help="restarts of every process after "
                        "one dies (default 0); each resumes")
    _args.recipe_flags(train)
    _args.add_json(train, help="print the result as JSON (the progress bar goes to stderr)")


_LAUNCH = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts")


def _launch(args) -> int:
    """``memfit train ... --nproc-per-node N``: the same command under torchrun (PyTorch's elastic
    launcher, in this process), one process per rank, less the flags that launched it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    rest, skip = [], False
    for item in args.argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in _LAUNCH:
            skip = "=" not in item
            continue
        rest.append(item)
    from memfit.techniques.recipe import Recipe

    given = _settings(args)["recipe"]
    if given == "auto":
        raise MemfitError("--recipe auto plans for one process: plan with `memfit plan --gpus N`, then pass the "
                          "recipe file with --nproc-per-node N")
    parallel = args.parallel or (Recipe.load(given) if given else Recipe()).parallel
    if str(parallel).startswith("zero"):
        raise MemfitError(f"memfit train does not run parallel={parallel} yet (memfit estimate answers for it): train "
                          "with --parallel fsdp or ddp, or run DeepSpeed itself (memfit plan --emit deepspeed)")
    if parallel == "none":
        raise MemfitError(f"--nproc-per-node {args.nproc_per_node} trains one model on several processes: pass "
                          "--parallel fsdp (shards it) or --parallel ddp (replicates it)")
    nodes = args.nnodes or 1
    if nodes > 1 and not args.rdzv_endpoint:
        raise MemfitError(f"--nnodes {nodes} needs --rdzv-endpoint host:port (a machine every node reaches)")
    if args.node_rank is not None and not 0 <= args.node_rank < nodes:
        raise MemfitError(f"--node-rank {args.node_rank} is not one of 0 .. {nodes - 1}")
    where = (["--standalone"] if nodes == 1 else
             ["--nnodes", str(nodes), "--node-rank", str(args.node_rank or 0), "--rdzv-backend", "c10d",
              "--rdzv-endpoint", args.rdzv_endpoint])
    command = ["--nproc-per-node", str(args.nproc_per_node), *where, "--max-restarts", str(args.max_restarts or 0),
               "-m", "memfit.cli", *rest]
    import os

    # torchrun's default is one thread per process (with a warning): the cores shared out instead
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    try:
        torchrun(command)
    except ChildFailedError as err:
        failures = "; ".join(f"rank {rank}: exit code {failure.exitcode}" for rank, failure in err.failures.items())
        print(f"memfit: error: a training process failed ({failures}); its own message is above. Rerun the same "
              "command to resume from the newest checkpoint", file=sys.stderr)
        return 1
    return 0


def _plans(args, s, recipe_arg, device: str, budget, changes: dict) -> bool:
    """Whether this run plans its recipe first: ``--recipe auto``, or no recipe file with a budget, a
    card or a GPU to train on (the fastest recipe that fits, as ``memfit plan`` finds it); not with
    ``--no-plan``, not for many processes (``plan --gpus N`` plans those)."""
    from memfit.training.ranks import under_torchrun

    if recipe_arg == "auto":
        if under_torchrun() or changes.get("parallel", "none") != "none":
            raise MemfitError("--recipe auto plans for one process: plan with `memfit plan --gpus N`, then pass "
                              "the recipe file with --nproc-per-node N")
        return True
    if recipe_arg is not None or args.no_plan or under_torchrun() or changes.get("parallel", "none") != "none":
        return False
    return budget is not None or s["gpu"] is not None or device.startswith("cuda")


def _planned(args, s, source, device: str, budget, changes: dict, quiet: bool = False):
    """The fastest recipe that fits (its ``Plan``), with ``changes`` (the recipe flags given) fixed: from the plan
    stored for the same question (``planner/stored.py``) unless ``--replan``, else planned now and
    stored. Says in one line on stderr what it chose, from where, and the predicted speed."""
    import time

    from memfit.estimator.inputs import Data, Hardware
    from memfit.planner.plan import plan
    from memfit.planner.stored import load_plan, plan_key, save_plan
    from memfit.units import format_size

    on_gpu = not device.startswith("cpu")
    rows = s["global_batch_size"] or max(1, (s["global_tokens"] or s["seq_len"]) // s["seq_len"])
    card = None
    if on_gpu:
        from memfit.hardware.gpus import target

        card = target("cuda", s["gpu"]).gpu
    question = {"budget": budget, "gpu": card.name if card is not None else None, "device": "cuda" if on_gpu else "cpu",
                "global_batch_size": rows, "seq_len": s["seq_len"], "fixed": changes, "timed": not args.no_calibrate,
                "allow": sorted(a.strip() for a in args.allow.split(",") if a.strip())}
    key = plan_key(source, **question)
    stored = None if args.replan else load_plan(key)
    start = time.perf_counter()
    measured = conf = None
    if stored is not None:
        chosen = stored["plan"]
        recipe, speed, need, whence = (stored["recipe"], stored.get("tokens_per_second"), stored.get("device_bytes"),
                                       "the stored plan (--replan plans again)")
        measured = stored.get("measured_tokens_per_second")
        if on_gpu:
            from memfit.training.loop import use_alloc_conf

            conf = use_alloc_conf([chosen])
    else:
        with _args.progress("planning the fastest recipe that fits") as update:
            plans = plan(source.config if source.config is not None else _args.model_of(args),
                         hardware=Hardware(gpu=card, budget=budget, device="cuda" if on_gpu else "cpu"),
                         data=Data(batch_size=rows, seq_len=s["seq_len"]), fixed=changes, allow=args.allow,
                         progress=update)
        chosen, timing = plans.best, None
        if on_gpu:
            from memfit.training.loop import use_alloc_conf

            conf = use_alloc_conf(plans[:4])
        if not args.no_calibrate:
            from memfit.training.calibrate import calibrate

            cap = budget if budget is not None else card.memory_bytes if card is not None else None
            with _args.progress(f"timing the {min(4, len(plans))} most promising recipes on this device"):
                timing = calibrate(plans, source.build, source.make_batch(rows, s["seq_len"]), device=device,
                                   budget=cap, gpu=card)
            chosen = next(p for p in plans if p.recipe == timing.recipe)
            if timing.measured_step_seconds:
                measured = rows * s["seq_len"] / timing.measured_step_seconds
        recipe, speed, need = chosen.recipe, chosen.tokens_per_second, chosen.device_bytes
        save_plan(key, chosen, question=question, planned_seconds=round(time.perf_counter() - start, 1),
                  measured_tokens_per_second=measured, timed=timing.to_dict() if timing is not None else None)
        whence = f"planned in {time.perf_counter() - start:.0f} s"
        if timing is not None:
            whence += f", the fastest of {sum(r['measured_step_seconds'] is not None for r in timing.rows)} timed"
    if not quiet:
        cap = budget if budget is not None else card.memory_bytes if card is not None else None
        room = f"{format_size(need)} of {format_size(cap)}" if need is not None and cap is not None else ""
        rate = f"predicted {speed:,.0f} tokens/s" if speed else "speed not predicted"
        if measured:
            rate += f", {measured:,.0f} timed here"
        fixed = f"; kept as given: {', '.join(f'{k}={v}' for k, v in changes.items())}" if changes else ""
        if conf:
            fixed += f"; PYTORCH_CUDA_ALLOC_CONF={conf} (the plan fits with it)"
        print(f"memfit train: fastest recipe that fits{' on the ' + card.name if card is not None else ''}: "
              f"{recipe.describe() or 'the default recipe'} ({rate}, {room}; {whence}{fixed})", file=sys.stderr)
    return chosen


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

    from memfit.training.ranks import under_torchrun

    if args.nproc_per_node and not under_torchrun():
        return _launch(args)
    if any(getattr(args, name.lstrip("-").replace("-", "_")) is not None for name in _LAUNCH[1:]) \
            and not args.nproc_per_node:
        raise MemfitError("--nnodes, --node-rank, --rdzv-endpoint and --max-restarts go with --nproc-per-node N")
    s = _settings(args)
    if s["data"] is None:
        raise MemfitError("no data: pass --data (a .bin token file, a .jsonl file or a saved dataset directory)")
    if s["seq_len"] is None:
        raise MemfitError("pass --seq-len: the longest example the run takes, in tokens")
    device = s["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "mps":
        from memfit.hardware.mps import require_mps

        require_mps()
    rank = 0
    if under_torchrun():  # one process per GPU
        import os

        rank = int(os.environ["RANK"])
        if device == "cuda":
            device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    budget = None if s["budget"] is None else parse_size(s["budget"])
    recipe_arg = s["recipe"]
    changes = {name: getattr(args, name) for name in Recipe.fields() if getattr(args, name, None) is not None}
    source = resolve(_args.model_of(args))
    if recipe_arg == "auto" and budget is None and s["gpu"] is None and device == "cpu":
        raise MemfitError("--recipe auto plans for a budget: pass --budget (or train on a GPU)")
    planned = None
    if _plans(args, s, recipe_arg, device, budget, changes):
        planned = _planned(args, s, source, device, budget, changes, quiet=rank != 0)
        base = planned.recipe
    else:
        base = Recipe.load(recipe_arg) if recipe_arg not in (None, "auto") else Recipe()
    recipe = base.replace(**changes) if changes else base
    card = s["gpu"]
    if card is None and device.startswith("cuda"):  # the card it trains on: its memory, its CUDA semantics
        from memfit.hardware.gpus import target

        card = target("cuda", None).gpu
    torch.manual_seed(s["seed"])
    with torch.device(device):  # initialised where it trains: a 1B model's random init takes seconds on a CPU
        model = source.build().to(device)
    from memfit.training.data import open_data

    data = open_data(s["data"], seq_len=s["seq_len"], tokenizer=s["tokenizer"], dtype=s["dtype"])
    result = train(model, data, recipe=recipe, budget=budget, global_batch_size=s["global_batch_size"],
                   global_tokens=s["global_tokens"], seq_len=s["seq_len"], steps=s["steps"], epochs=s["epochs"],
                   lr=float(s["lr"]), schedule=s["schedule"], warmup=int(s["warmup"]), out_dir=s["out_dir"],
                   resume=bool(s["resume"]), seed=int(s["seed"]), checkpoint_every=int(s["checkpoint_every"]),
                   keep=int(s["keep"]), workers=int(s["workers"]), gpu=card, tensorboard=s["tensorboard"],
                   packed=bool(s["packed"]), progress=True, plan=planned if planned is not None and
                   planned.recipe == recipe else None)
    if rank != 0:  # rank 0 speaks for the run
        return _done(0)
    summary = {"steps": result.steps, "resumed_from": result.resumed_from,
               "final_loss": result.losses[-1] if result.losses else None, "ooms": result.ooms,
               "peak_bytes": result.peak_bytes, "tokens_per_second": round(result.tokens_per_second, 1),
               "out_dir": str(result.out_dir), "recipe": recipe.to_dict(), "processes": result.world_size}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        loss = "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
        on = f" on {result.world_size} processes" if result.world_size > 1 else ""
        print(f"trained {result.steps} steps{on} (resumed at {result.resumed_from}); loss {loss}; "
              f"{result.tokens_per_second:,.0f} tokens/s; peak {format_size(result.peak_bytes)}; "
              f"{len(result.ooms)} out-of-memory errors survived; checkpoints in {result.out_dir}", file=sys.stdout)
    return _done(0)


def _done(code: int) -> int:
    """The exit of a training process. Under torchrun, once train() has returned (every checkpoint
    committed, the process group destroyed, the DataLoader workers and TensorBoard writer closed) and this
    rank's output is flushed, the process ends here with ``os._exit``: about one 2-rank run in a hundred
    otherwise aborted in C++ static teardown at interpreter exit ("terminate called without an active
    exception", gloo's threads; seen in a hand-written FSDP2 loop with no memfit code too), which torchrun
    reports as a failed rank after the work was done. Nothing is left for that teardown to do."""
    from memfit.training.ranks import under_torchrun

    if not under_torchrun():
        return code
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
