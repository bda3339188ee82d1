"""``train``: run a recipe's step over a dataset inside a memory budget, surviving out-of-memory
errors without losing or repeating a sample, resumable from atomic checkpoints.

One optimizer step takes the next global batch from a seeded, resumable order (``data.Order``):
``global_batch_size`` examples, or examples until ``global_tokens`` tokens. The batch is cut into
micro-batches, rows sorted by length (``batching.micro_batches``), so short rows come many to a
micro-batch and long ones few. With a budget each micro-batch is as many rows as memfit's estimate
of that shape says fit (``predict.ShapeBudget``: the shape's predicted peak within the budget,
micro-batches padded to 1/16-length buckets so the shape estimated is the shape run); without
one, or with ``micro_tokens``, the cap is padded tokens (the recipe's micro_batch_size x the
longest example). The step is ``apply()``'s (what was estimated is what runs): forward and
backward of each micro-batch with losses weighted by tokens, then the optimizer through
``SafeStep`` (the recipe's ``safe_step``, 8 chunks unless it says otherwise; a fused optimizer needs none:
its step allocates before its one kernel writes, so an OOM in it has changed nothing, and the copies
would add to the step's peak the largest chunk's parameters and AdamW state, which the plan does not
count: on Llama-3.2-1B the tied embedding alone, 3 GiB). Batches are read by a
``DataLoader`` (``workers`` processes; on CUDA pinned and copied with ``non_blocking``).

An out-of-memory error in forward or backward drops the gradients, halves the micro-batches'
rows (or token cap) and redoes the same global batch; one inside the optimizer step is rolled back chunk by chunk by
``SafeStep`` and the step goes on. Either way the global batch, and so the update, is unchanged,
and the event is logged (step, phase, micro-batch, cap). After ``grow_after`` clean steps the cap
doubles back toward the plan's. On the CPU ``budget`` is a ``VirtualBudget`` (real tensors, a byte
cap); on CUDA ``torch.cuda.set_per_process_memory_fraction``.

Every ``checkpoint_every`` steps (and at the end) weights, optimizer, scheduler, RNG states, the
data position and the cap are saved atomically (``checkpoint.py``); ``resume=True`` continues
from the newest checkpoint exactly where it was. ``metrics.jsonl`` gets one line per step: loss,
tokens, tokens/s, the example ids of the batch, memory (now, peak, predicted), the micro-batches,
and OOM events; the same scalars go to TensorBoard when it is installed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.hardware.cluster import real_world
from memfit.techniques.apply import apply
from memfit.techniques.recipe import Recipe
from memfit.techniques.safe_step import TRAIN_CHUNKS
from memfit.accounting.budget import VirtualBudget
from memfit.training.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from memfit.training.data import Order, open_data
from memfit.training.global_step import one_step
from memfit.training.lockstep import Lockstep
from memfit.training.predict import ShapeBudget, meta_copy, model_identity
from memfit.training.progress import Progress, tensorboard_writer
from memfit.training.ranks import join
from memfit.training.reader import Reader
from memfit.training.sharded import export_safetensors, is_sharded, load_sharded, save_sharded
from memfit.units import parse_size

__all__ = ["train", "TrainResult"]

SCHEDULES = ("constant", "cosine")

#: ``out_dir``'s file of the micro-batch estimates (``predict.ShapeBudget``): a resumed or repeated run
#: with the same model, recipe and budget reads them instead of estimating again
ESTIMATES = "estimates.json"


@dataclass
class TrainResult:
    """What a run did."""

    steps: int  # optimizer steps taken in total (resumed ones included)
    losses: list[float]  # the loss of each step this call ran
    ooms: list[dict] = field(default_factory=list)  # one per out-of-memory error survived
    peak_bytes: int = 0  # the highest memory in use (virtual budget or CUDA max_memory_allocated)
    tokens_per_second: float = 0.0
    out_dir: Path | None = None
    resumed_from: int = 0  # the step the run resumed at (0: fresh)
    rank: int = 0  # this process's rank in a data-parallel run
    world_size: int = 1  # the run's processes


def use_alloc_conf(plans) -> str | None:
    """The CUDA allocator setting the plans need (``Plan.alloc_conf``: a plan that fits only with expandable
    segments, the planner's verdict), applied to this process unless the user set ``PYTORCH_CUDA_ALLOC_CONF``
    (theirs wins); returns what was applied. Without it such a plan's recipe runs out of memory on the card it
    was planned for: the planner counted on segments that grow in place instead of new cached blocks.""" 
    import os

    wanted = next((p.alloc_conf for p in plans if p is not None and getattr(p, "alloc_conf", None)), None)
    if wanted is None or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or not torch.cuda.is_available():
        return None
    torch.cuda.memory._set_allocator_settings(wanted)  # takes effect for the segments made from now on
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = wanted  # and in the processes this one starts
    return wanted


def _schedule(name: str, lr: float, warmup: int, total: int):
    if name not in SCHEDULES:
        raise MemfitError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _global_batch(order: Order, lengths, rows: int | None, tokens: int | None) -> list[int]:
    if rows is not None:
        return order.take(rows)
    ids, count = [], 0
    while count < tokens:
        (i,) = order.take(1)
        ids.append(i)
        count += int(lengths[i])
    return ids


def train(model, data, *, recipe: Recipe | None = None, budget=None, global_batch_size: int | None = None,
          global_tokens: int | None = None, seq_len: int | None = None, steps: int | None = None,
          epochs: float | None = None, lr: float = 1e-4, schedule: str = "cosine", warmup: int = 0,
          out_dir="memfit-run", resume: bool = True, seed: int = 0, checkpoint_every: int = 50, keep: int = 2,
          micro_tokens: int | None = None, batching: str = "tokens", grow_after: int = 20,
          chunks: int | None = TRAIN_CHUNKS, tokenizer=None, pad_id: int = 0, device=None, gpu=None, workers: int = 0,
          tensorboard: bool | None = None, packed: bool = False, inject=(), progress: bool = True,
          export: bool = True, plan=None) -> TrainResult:
    """Train ``model`` on ``data`` with ``recipe`` inside ``budget``; see the module docstring.

    model          an ``nn.Module`` (trained in place)
    data           a dataset of ``{"input_ids"}`` examples with ``lengths``, or a path (``data.open_data``)
    recipe         a :class:`memfit.Recipe` (default: the plain step); its micro_batch_size x seq_len
                   is the micro-batch token cap when there is no budget and no ``micro_tokens``
    batching       ``tokens``: micro-batches by padded tokens, rows sorted by length (the default);
                   ``rows``: micro_batch_size rows in data order, each padded to its longest (the plain
                   loop, for comparison; an OOM halves the rows)
    budget         bytes or a size: on the CPU a virtual budget; on CUDA the process's memory, its CUDA
                   context included, as ``plan`` and the verdict count it (torch's allocator gets the budget
                   less the card's context: ``set_per_process_memory_fraction``); micro-batches are then sized
                   by their estimated peak (``predict.ShapeBudget``)
    gpu            on CUDA, the catalog GPU the estimates follow (``memfit.estimate``'s ``gpu``); with no
                   budget, its memory is the budget
    chunks         the optimizer step in this many chunks, rolled back on OOM (``Recipe.safe_step``; the
                   recipe's own value wins; not added to a fused optimizer, see above; None: the plain step,
                   an OOM inside it is fatal)
    workers        DataLoader worker processes collating micro-batches (0: in this process)
    packed         documents packed first-fit-decreasing into rows of ``seq_len`` tokens, attention kept
                   within each document (``position_ids`` restarting per document, ``use_cache=False``;
                   labels ignored at each document's first token); causal LMs only
    tensorboard    also write the metrics as TensorBoard scalars to ``out_dir/tensorboard`` (None: when
                   the ``tensorboard`` package is installed; True: required)
    global_batch_size / global_tokens   examples, or tokens, per optimizer step (one of them)
    steps / epochs how long (one of them)
    inject         faults for tests: ``(step, micro_batch, phase[, nth])`` (``budget.VirtualBudget``)
    export         a data-parallel run also writes the final weights as one ``model.safetensors`` in its
                   last checkpoint (a one-process checkpoint is one already)
    plan           the ``Plan`` this run follows (``memfit.plan``'s choice; ``memfit train`` passes its own):
                   its recipe is the run's when ``recipe`` is None, and its predicted step time (a global batch
                   of full-length rows) is written beside each step's measured ``seconds`` in metrics.jsonl
                   (``predicted_step_seconds``); where every row has ``seq_len`` tokens and the plan was made
                   for that length and fits the budget, its micro-batch and full estimate size the run's
                   micro-batches (no estimate of its own before the first step)

    Under torchrun (or inside an initialised process group) with ``parallel=fsdp`` or ``ddp``, every
    rank runs this with the same arguments: each takes its share of every global batch, an
    out-of-memory error on any rank is redone by all (``lockstep.py``), checkpoints are
    sharded (``sharded.py``) and rank 0 writes the metrics and the progress bar.
    """
    if plan is not None and not hasattr(plan, "step_seconds"):
        raise MemfitError(f"plan must be a memfit Plan (memfit.plan(...)[0]), got {type(plan).__name__}")
    recipe = recipe or (plan.recipe if plan is not None else Recipe())
    meshed = [f"{name}={getattr(recipe, name)}" for name in ("tp", "pp", "cp") if getattr(recipe, name) > 1]
    if str(getattr(recipe, "parallel", "")).startswith("zero"):  # DeepSpeed's engine: run it with DeepSpeed itself
        meshed.append(f"parallel={recipe.parallel} (memfit plan --emit deepspeed writes its ds_config.json)")
    # estimated per rank (memfit estimate --gpus N), not yet trained: TP and CP peers and stages read the same rows
    if meshed:
        raise MemfitError(f"memfit train does not run {' and '.join(meshed)} yet (memfit estimate answers for it): "
                          "train with parallel=fsdp or ddp")
    if not isinstance(recipe, Recipe):
        raise MemfitError(f"recipe must be a memfit.Recipe, got {type(recipe).__name__}: plan one with memfit.plan")
    if recipe.safe_step is None and chunks is not None and recipe.optimizer_impl != "fused":
        with contextlib.suppress(MemfitError):  # fp16-mixed, in-backward, 8-bit: the plain step
            recipe = recipe.replace(safe_step=chunks)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise MemfitError(f"workers must be 0 or more DataLoader processes, got {workers!r}")
    if (global_batch_size is None) == (global_tokens is None):
        raise MemfitError("give one of global_batch_size (examples per step) or global_tokens (tokens per step)")
    if (steps is None) == (epochs is None):
        raise MemfitError("give one of steps or epochs")
    if batching not in ("tokens", "rows"):
        raise MemfitError(f"unknown batching {batching!r}: choose tokens or rows")
    if packed and (batching == "rows" or seq_len is None):
        raise MemfitError("packed=True packs documents into rows of seq_len tokens: give seq_len and keep "
                          "batching='tokens'")
    if batching == "rows" and recipe.micro_batch_size is None:
        raise MemfitError("batching='rows' needs the recipe's micro_batch_size")
    if recipe.grad_accum_steps > 1 and micro_tokens is None and recipe.micro_batch_size is None:
        raise MemfitError("the recipe accumulates without a micro_batch_size: set micro_batch_size or micro_tokens")
    if not isinstance(data, torch.utils.data.Dataset):
        if seq_len is None:
            raise MemfitError("reading data from a path needs seq_len (tokens per example at most)")
        data = open_data(data, seq_len=seq_len, tokenizer=tokenizer)
    lengths = getattr(data, "lengths", None)
    if lengths is None:
        raise MemfitError("the dataset needs a lengths array (tokens per example): use memfit.training.data")
    longest = int(max(lengths)) if seq_len is None else seq_len
    by_estimate = micro_tokens is None and batching == "tokens"  # with a budget: ShapeBudget sizes micro-batches
    if micro_tokens is None:
        rows = recipe.micro_batch_size or (global_batch_size if global_batch_size else max(1, global_tokens // longest))
        micro_tokens = rows * longest
    device = torch.device(device) if device is not None else next(model.parameters()).device
    ranks = join(device)  # a data-parallel run: torchrun's (or the caller's) process group
    if ranks is not None and ranks.world > 1 and recipe.parallel == "none":
        raise MemfitError(f"{ranks.world} processes train one model only with parallel=fsdp or ddp: pass "
                          "--parallel fsdp (shards) or --parallel ddp (replicates)")
    if ranks is not None and recipe.parallel == "none":
        ranks = None  # one process under torchrun: trains as one process
    if ranks is not None and by_estimate and budget is not None:
        # a per-rank estimate runs under a fake process group, which cannot sit beside the real one
        by_estimate = False
    order = Order(len(data), seed=seed)
    per_epoch = (len(data) / global_batch_size) if global_batch_size else (int(sum(lengths)) / global_tokens)
    total_steps = steps if steps is not None else max(1, math.ceil(epochs * per_epoch))

    cap = None if budget is None else parse_size(budget)
    card = None
    if device.type == "cuda":  # the budget is the process's, what is outside the allocator included, as plan counts it
        from memfit.hardware.gpus import gpu as catalog_gpu

        card = gpu or "h100-sxm"
        card = catalog_gpu(card) if isinstance(card, str) else card
        if cap is None and gpu is not None:
            cap = card.memory_bytes
        use_alloc_conf([plan])  # before the estimates: a plan that needs expandable segments is judged with them
    shapes = None
    if cap is not None and by_estimate:
        template = meta_copy(model)  # apply changes the model in place; estimates start from this
        most = global_batch_size or max(1, global_tokens // max(1, int(min(lengths))))
        uniform = not packed and int(min(lengths)) == int(max(lengths)) == longest  # a token file's rows
        shapes = ShapeBudget(lambda: copy.deepcopy(template), recipe, cap, longest=longest, max_rows=most,
                             gpu=card, pad_id=pad_id,
                             packed=packed, store=Path(out_dir) / ESTIMATES, identity=model_identity(model),
                             uniform=uniform)
        if uniform and plan is not None and plan.verified and plan.seq_len == longest and \
                plan.recipe.micro_batch_size and plan.recipe == recipe and plan.device_bytes <= cap:
            # the plan's full estimate is this run's micro-batch: no estimate before the first step (a plan that
            # is only predicted, a calibrated choice past the planner's first, is checked by the run's estimates)
            shapes.known(longest, plan.recipe.micro_batch_size,
                         plan.device_bytes if card is not None else plan.allocated_bytes)

    torch.manual_seed(seed)
    if ranks is None:
        model, opt, step_fn = apply(model, recipe)
    else:
        with real_world(broadcast_buffers=False):  # no collective in DDP's forward (lockstep.py)
            model, opt, step_fn = apply(model, recipe)
        ranks.lockstep = Lockstep(model, recipe, device)
    # an optimizer without an lr in each group (a caller's own) steps at its own rate
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(schedule, lr, warmup, total_steps)) \
        if getattr(opt, "param_groups", None) and all("lr" in g for g in opt.param_groups) else None
    if sched is not None:
        for group in opt.param_groups:
            group["lr"] = lr * sched.lr_lambdas[0](sched.last_epoch)
            group["initial_lr"] = lr
        sched.base_lrs = [lr] * len(opt.param_groups)

    out_dir = Path(out_dir)
    scale, clean, done, resumed = 1.0, 0, 0, 0
    newest = latest_checkpoint(out_dir) if resume else None
    if ranks is not None:
        newest = ranks.same(newest)  # every rank resumes the checkpoint rank 0 sees
    if newest is not None:
        if is_sharded(newest):
            state, rng = load_sharded(newest, model, opt)
            rng = rng or (state.get("rng") if ranks is None else None)
        elif ranks is not None:
            raise MemfitError(f"{newest} was written by one process: resume it with one process (or start "
                              "afresh with --no-resume / another --out-dir)")
        else:
            state = load_checkpoint(newest, model)
            opt.load_state_dict(state["optimizer"])
            rng = state["rng"]
        if sched is not None:
            sched.load_state_dict(state["scheduler"])
            for group in opt.param_groups:  # this run's schedule (a resumed run may be given more steps)
                group["lr"] = lr * sched.lr_lambdas[0](sched.last_epoch)
        order.load_state_dict(state["order"])
        if rng is not None:
            set_rng_state(rng)
        else:  # more ranks than wrote it: this rank's generators from the seed
            torch.manual_seed(seed + 1000 * (ranks.rank if ranks is not None else 0) + state["step"])
        scale, clean, done = state["scale"], state["clean"], state["step"]
        resumed = done
    rank, world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    vb = None
    if device.type == "cpu" and (cap is not None or inject):
        resident = sum(t.untyped_storage().nbytes() for t in {p.untyped_storage().data_ptr(): p for p in
                       map(_local, list(model.parameters()) + list(model.buffers()))}.values())
        vb = VirtualBudget(cap, resident=resident, inject=inject)
    elif cap is not None and device.type == "mps":  # the high watermark at the budget (hardware/mps.py)
        from memfit.hardware.mps import memory_fraction

        torch.mps.set_per_process_memory_fraction(memory_fraction(cap, torch.mps.recommended_max_memory()))
    elif cap is not None:
        from memfit.estimator.verdict import limits, run_outside

        # the budget is what nvidia-smi shows: less what this rank holds outside the allocator (its communicators)
        total = torch.cuda.get_device_properties(device).total_memory
        allowed = limits(card, min(cap, card.memory_bytes), run_outside(card, recipe, world).bytes)[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    result = TrainResult(steps=done, losses=[], out_dir=out_dir, resumed_from=resumed, rank=rank, world_size=world)
    bar = Progress(total_steps, done) if progress and rank == 0 else None
    tokens_run, seconds = 0, 0.0
    reader = Reader(data, pad_id, workers, device, seq_len if packed else None)
    if ranks is not None:  # every kind of micro-batch once, so a first one that runs out can be recovered
        ranks.lockstep.warm_up(reader.read([[(0, 0)]], None)[0], step_fn)
        if vb is not None:
            ranks.lockstep.place = lambda what: vb.at(done, -1, what)
    board = tensorboard_writer(out_dir, tensorboard) if rank == 0 else None
    with (open(out_dir / "metrics.jsonl", "a", encoding="utf-8") if rank == 0 else contextlib.nullcontext()) as log, \
            (vb if vb is not None else contextlib.nullcontext()):
        while done < total_steps:
            ids = _global_batch(order, lengths, global_batch_size, global_tokens)
            start = time.perf_counter()
            loss, events, predicted, estimating, parts = one_step(
                step_fn, reader, ids, lengths, micro_tokens, scale, vb, done, device,
                recipe.micro_batch_size if batching == "rows" else None, shapes, seq_len if packed else None, ranks)
            if events:
                scale = events[-1]["scale"]
                clean = 0
                result.ooms.extend(events)
            else:
                clean += 1
                if scale < 1.0 and clean >= grow_after:
                    scale, clean = min(1.0, scale * 2), 0
            step_lr = opt.param_groups[0]["lr"] if sched is not None else None  # what this step stepped with
            if sched is not None:
                sched.step()
            elapsed = time.perf_counter() - start - estimating  # estimates are timed apart
            tokens = int(sum(lengths[i] for i in ids))
            tokens_run, seconds = tokens_run + tokens, seconds + elapsed
            done += 1
            value = float(loss)
            now, memory = _memory(vb, device)
            line = {"step": done, "loss": value, "tokens": tokens, "seconds": round(elapsed, 6),
                    "tokens_per_second": round(tokens / elapsed, 2), "examples": ids,
                    "memory_now": now, "memory_peak": memory, "predicted": predicted,
                    "estimate_seconds": round(estimating, 3), "micro_batches": parts, "lr": _number(step_lr),
                    "predicted_step_seconds": None if plan is None else round(plan.step_seconds, 6),
                    "micro_token_cap": None if shapes is not None else int(micro_tokens * scale),
                    "ooms": events}
            if ranks is not None:  # one all-gather: the world's loss, each rank's memory and time
                if vb is not None:
                    vb.at(done, -1, "metrics")
                value, elapsed = ranks.line(line, value, now, memory, predicted, elapsed, parts)
                line["seconds"], line["tokens_per_second"] = round(elapsed, 6), round(tokens / elapsed, 2)
                seconds += elapsed - line["ranks"][rank]["seconds"]  # the slowest rank's time
            result.losses.append(value)
            if log is not None:
                log.write(json.dumps(line) + "\n")
                log.flush()
            if bar is not None:
                bar.update(done, value, tokens / elapsed, line["memory_now"], line["memory_peak"], line["predicted"])
            if board is not None:
                for name, number in (("loss", value), ("tokens_per_second", tokens / elapsed), ("memory_peak", memory),
                                     ("predicted", predicted), ("ooms", len(events)),
                                     ("lr", _number(step_lr))):
                    if number is not None:
                        board.add_scalar(f"train/{name}", number, done)
            if done % checkpoint_every == 0 or done == total_steps:
                with _uncounted():  # host memory, not the budget's
                    state = {"scheduler": sched.state_dict() if sched is not None else {}, "order": order.state_dict(),
                             "scale": scale, "clean": clean, "step": done}
                    if ranks is None:
                        save_checkpoint(out_dir, done, model, {"optimizer": opt.state_dict(), "rng": rng_state(),
                                                               **state}, keep=keep)
                    else:
                        final = save_sharded(out_dir, done, model, opt, state, rng_state(), keep=keep)
                        if done == total_steps and export:
                            export_safetensors(model, final / "model.safetensors")
    reader.close()
    if ranks is not None:
        ranks.close()
    if board is not None:
        board.close()
    if bar is not None:
        bar.close()
    result.steps = done
    result.peak_bytes = _memory(vb, device)[1] or 0
    result.tokens_per_second = tokens_run / seconds if seconds else 0.0
    return result


def _local(tensor):
    """A DTensor's shard on this rank (FSDP2's parameters); any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _uncounted():
    """Outside the virtual budget (``VirtualBudget`` is a dispatch mode): checkpoints are host memory."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _memory(vb, device) -> tuple:
    """(in use now, peak) in bytes: the virtual budget's, CUDA's counters, or (None, None) on a CPU
    run without a budget (nothing counts there, so nothing slows the step)."""
    if vb is not None:
        return vb.total, vb.peak
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    if device.type == "mps":  # torch.mps has no peak before 2.13's torch.accelerator counters: now's, sampled
        now = torch.mps.current_allocated_memory()
        peak = torch.accelerator.max_memory_allocated() if hasattr(torch.accelerator, "max_memory_allocated") else now
        return now, max(now, peak)
    return None, None


def _number(value):
    """A float for the metrics line (an lr may be a tensor, as torch's capturable optimizers keep it)."""
    return None if value is None else round(float(value), 12)
