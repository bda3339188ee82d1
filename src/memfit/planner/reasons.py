"""Why ``plan`` chose what it chose, and what to try when nothing fits.

For each non-default field of the choice, what leaving it out would cost or save; the memory/speed
front of all candidates; the verdict's caveats of a chosen plan; the ``NothingFits`` answer with
its fixes.
"""

from __future__ import annotations

import math

from memfit.errors import MemfitError
from memfit.planner.result import NothingFits, Plan
from memfit.techniques.recipe import Recipe
from memfit.units import format_size



def _front(predicted: list[Plan]) -> list[Plan]:
    """Smallest first; each point faster than every smaller one."""
    front, best = [], math.inf
    for p in sorted(predicted, key=lambda p: (p.device_bytes, p.step_seconds)):
        if p.step_seconds < best:
            front.append(p)
            best = p.step_seconds
    return front


def _reasons(exact: Plan, chosen: Plan, predicted: list[Plan], budget: int, engine) -> list[str]:
    """For each non-default field of the choice: what leaving it out would cost or save (all
    predicted figures, so they compare like with like)."""
    table = {p.recipe: p for p in predicted}
    r = chosen.recipe
    out = []
    default = Recipe()
    speed = engine.speed.name

    def compare(field_name, alt):
        other = table.get(alt)
        if other is None:
            return
        value = getattr(r, field_name)
        if other.device_bytes > budget:
            out.append(f"{field_name}={value}: without it ({getattr(alt, field_name)}) the step needs "
                       f"{format_size(other.device_bytes)}, over the {format_size(budget)} budget")
        else:
            dt = other.step_seconds / chosen.step_seconds - 1
            out.append(f"{field_name}={value}: {abs(dt):.0%} {'faster' if dt > 0 else 'slower'} than "
                       f"{getattr(alt, field_name)} on {speed} ({format_size(chosen.device_bytes)} vs "
                       f"{format_size(other.device_bytes)})")

    for name in _searched_fields():
        if getattr(r, name) != getattr(default, name):
            try:
                compare(name, r.replace(**{name: getattr(default, name)}))
            except MemfitError:
                pass
    if r.grad_accum_steps > 1:
        doubled = table.get(r.replace(micro_batch_size=r.micro_batch_size * 2,
                                      grad_accum_steps=r.grad_accum_steps // 2)) if r.grad_accum_steps % 2 == 0 else None
        bigger = [doubled] if doubled is not None else []
        if bigger and bigger[0].device_bytes > budget:
            out.append(f"micro_batch_size={r.micro_batch_size} x {r.grad_accum_steps} accumulation steps: micro-batch "
                       f"{r.micro_batch_size * 2} needs {format_size(bigger[0].device_bytes)}, over budget")
        else:
            out.append(f"micro_batch_size={r.micro_batch_size} x {r.grad_accum_steps} accumulation steps")
    out.append(f"fits with {format_size(budget - exact.device_bytes)} to spare of {format_size(budget)} by a full "
               f"estimate ({format_size(exact.device_bytes)}; composed prediction {format_size(chosen.device_bytes)})")
    if exact.alloc_conf:
        out.append(f"fits only with PYTORCH_CUDA_ALLOC_CONF={exact.alloc_conf}: the default allocator runs out "
                   "(fragmentation); set it before the first CUDA allocation")
    return out


def _searched_fields() -> list[str]:
    """The fields the planner searches, in the recipe's order; micro-batch and accumulation are
    explained together below."""
    from memfit.techniques.registry import fields, techniques

    searched = {f.name for t in techniques() if t.search is not None for f in t.fields}
    return [f.name for f in fields() if f.name in searched and f.name not in ("micro_batch_size", "grad_accum_steps")]


def _nothing_fits(engine, checked, budget: int, allowed: set[str]) -> NothingFits:
    def needed(report):  # out of memory on a GPU: what it holds at the limit and what is missing
        return report.device_bytes + (report.missing_bytes or 0)

    if not checked:  # every candidate predicted to fit needed more in full (a Mac's heaps: ``estimator/mps_fit.py``)
        return NothingFits(f"nothing fits {format_size(budget)}: each recipe predicted to fit needed more when "
                           "estimated in full; try a shorter sequence, --allow lora,qlora,adamw8bit, or more memory",
                           None)
    best, full = min(checked, key=lambda pair: needed(pair[1]))
    reserved = None if full.reserved_bytes is None else full.reserved_bytes + (full.missing_bytes or 0)
    smallest = Plan(best.recipe, full.peak_bytes, reserved, needed(full), best.step_seconds,
                    best.samples_per_second, best.tokens_per_second, verified=True, verdict=full.verdict)
    fixes = []
    if engine.seq_len and engine.source.task != "image-classification":
        fixes.append(f"a shorter sequence than {engine.seq_len}")
    # 8-bit states only for an optimizer memfit builds by name (``space.by_name``)
    missing = [a for a in ("lora", "qlora", "adamw8bit") if a not in allowed
               and not (a == "adamw8bit" and engine.factory is not None)]
    if missing:
        fixes.append(f"allowing {','.join(missing)} (--allow)")
    if engine.target is not None:
        from memfit.hardware.gpus import CATALOG

        bigger = sorted((g for g in CATALOG.values() if g.memory_bytes >= smallest.device_bytes
                         and g.vendor == engine.target.vendor),
                        key=lambda g: g.memory_bytes)
        if bigger:
            fixes.append(f"a bigger card ({bigger[0].name}, {format_size(bigger[0].memory_bytes)})")
        fixes.extend(_sharding(engine, budget))
    return NothingFits(
        f"nothing fits {format_size(budget)}: the smallest recipe found ({smallest.recipe.describe()}) needs "
        f"{format_size(smallest.device_bytes)}; try " + ", or ".join(fixes), smallest)


def _sharding(engine, budget: int) -> list[str]:
    """FSDP2's CPU offload on this one card, and the fewest GPUs FSDP2 fits over, each from a real
    per-rank estimate (``ranks.offload_fits``, ``ranks.smallest_world``)."""
    from memfit.planner.ranks import WORLDS, NoWorld, offload_fits, smallest_world

    if engine.factory is not None:  # the per-rank estimates build the optimizer by name
        return ["sharding over several GPUs or FSDP2's CPU offload (not estimated here: with your optimizer "
                "by name, memfit plan --gpus N sizes it)"]
    args = (engine.source, engine.target, budget, engine.global_batch_size, engine.seq_len, engine.optimizer,
            engine.loss_fn)
    out = []
    try:
        offload = offload_fits(*args)
        found = smallest_world(*args)
    except NoWorld as err:
        return [f"FSDP2's CPU offload on this card ({format_size(offload.device_bytes)} on the GPU)"
                if offload is not None else "FSDP2's CPU offload (it does not fit this card either)", str(err)]
    except MemfitError as err:  # a model the fake process group cannot shard: say so, do not guess
        return [f"sharding over several GPUs (FSDP2 could not be estimated here: {err})"]
    if offload is not None:
        out.append(f"FSDP2's CPU offload on this card ({format_size(offload.device_bytes)} on the GPU and "
                   f"{format_size(offload.host_bytes or 0)} of host RAM by an estimate of "
                   f"{Recipe.from_dict(offload.settings['recipe']).describe()}; memfit plan --gpus 1)")
    if found is None:
        return out + [f"sharding over more than {WORLDS[-1]} GPUs, or over nodes (memfit plan --gpus N --nodes M)"]
    world, report = found
    recipe = Recipe.from_dict(report.settings["recipe"]).describe()
    return out + [f"sharding with FSDP2 over {world.size} GPUs ({format_size(report.device_bytes)} per rank by a "
                  f"per-rank estimate of {recipe}; memfit plan --gpus {world.size} for the fastest)"]


def _caveats(report) -> list[str]:
    """What the verdict adds to a chosen plan: cudaFree-and-retry rounds, and a tight fit."""
    out = []
    if report.retries:
        out.append(f"torch frees its cache and retries {report.retries} time(s) in the traced steps (each "
                   "synchronises the GPU: slower than predicted)")
    if report.tight:
        out.append(f"tight: {format_size(report.headroom_bytes)} left is less than the measured estimation error "
                   f"({format_size(report.error_margin_bytes)}); a little more budget, or the next plan, is safer")
    return out
