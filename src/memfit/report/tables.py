"""Tables for people: a ``Report`` drawn with rich.

The CLI prints these; ``--json`` prints ``Report.to_dict()`` instead. Nothing here computes a
number the report does not already hold, except the budget margin.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from memfit.categories import GENERATE_PHASES, PHASES, Category
from memfit.report.report import ERROR_SOURCE, EXPANDABLE, OOM, Report, semantics_word, target_line, verdict_line
from memfit.units import format_size

__all__ = ["report_view", "verdict", "plan_view", "fit_view", "longest_view", "front_around"]

NEIGHBOURS = 3  # front points shown on each side of the chosen plan; --json has them all


#: after the parameter count of a pipeline's report: its worst rank holds one stage's
STAGE = " in the worst rank's stage"


def verdict(report: Report, budget: int | None = None) -> dict:
    """Whether the step fits, and by how much.

    On a GPU (``report.verdict`` set) what torch's allocator would do on the card, replayed under its
    limit (``memfit/estimator/verdict.py``): ``verdict``, ``alloc_conf`` (the setting it needs, if any), ``retries``,
    ``missing_bytes``, ``tight`` and the error margin; with paged optimizer state, ``managed_bytes``,
    ``managed_resident_bytes`` and ``paged_bytes`` (``Report``); ``budget_bytes`` is the card's memory or the
    budget the report was made for, ``margin_bytes`` what is left. On the CPU the peak against ``budget``.
    """
    if report.verdict is None:
        margin = budget - report.device_bytes
        return {"budget_bytes": budget, "needed_bytes": report.device_bytes, "fits": margin >= 0,
                "margin_bytes": margin}
    limit = report.capacity_bytes + report.outside_total
    managed = {} if not report.managed_bytes else {
        "managed_bytes": report.managed_bytes, "managed_resident_bytes": report.managed_resident_bytes,
        "paged_bytes": report.paged_bytes}
    return managed | {"verdict": report.verdict, "fits": report.verdict != OOM,
            "alloc_conf": "expandable_segments:True" if report.verdict == EXPANDABLE else None,
            "budget_bytes": limit, "needed_bytes": report.device_bytes, "margin_bytes": report.headroom_bytes,
            "capacity_bytes": report.capacity_bytes, "retries": report.retries,
            "missing_bytes": report.missing_bytes, "tight": report.tight,
            "error_margin_bytes": report.error_margin_bytes, "error_margin_source": ERROR_SOURCE}


def report_view(report: Report, name: str, budget: int | None = None, recipe=None) -> Group:
    """``recipe``: the Recipe the report was made with, when the caller holds it (the CLI does);
    without it, the one recorded in ``report.settings`` (a generation has none: its settings are shown)."""
    generation = report.settings.get("workload") == "generate"
    script = report.settings.get("script")  # a user's own script (memfit.estimate_script): no recipe of memfit's
    if recipe is None and not generation and script is None:
        from memfit.techniques.recipe import Recipe

        recipe = Recipe.from_dict(report.settings["recipe"])
    what = (_generation(report.settings) if generation else
            f"{script['steps']} optimizer step(s) as the script runs them" if script is not None else recipe.describe())
    title = (f"{name}: {what}, "
             f"{report.parameters / 1e9:.3f}B params"
             f"{STAGE if (report.world or {}).get('pp', 1) > 1 else ''} "
             f"({report.method} on {semantics_word(report)} semantics)")
    parts = [Text(target_line(report), style="bold"), Text(title, style="bold")]
    if report.world is not None:
        w = report.world
        cluster = f"{w['size']} GPU(s)" if w["nodes"] == 1 else f"{w['nodes']} nodes x {w['gpus']} GPUs"
        layout = w["parallel"]
        if w.get("pp", 1) > 1 or w.get("tp", 1) > 1:  # the mesh, as hardware.cluster.Layout describes it
            layout = w.get("mesh") or f"pp={w.get('pp', 1)} x tp={w.get('tp', 1)}"
            if w.get("pp", 1) > 1:
                layout += f" ({recipe.pp_schedule}, {recipe.grad_accum_steps} micro-batches)"
            if w["parallel"] != "none" and "dp=" in layout:
                layout += f", {w['parallel']} over dp"
        stage = (lambda r: f" (stage {r['rank'] * w['pp'] // w['size']})") if w.get("pp", 1) > 1 else (lambda r: "")
        parts.append(Text(f"per rank: {layout} over {cluster}; rank {w['rank']}'s step, the highest peak of "
                          + ", ".join(f"rank {r['rank']}{stage(r)} {format_size(r['device_bytes'])}"
                                      for r in report.ranks)))
    if report.devices is not None:
        parts.append(_devices(report))
    if recipe is not None and not generation and not recipe.is_exact:
        parts.append(Text(f"changes the math: {', '.join(recipe.approximations)}", style="yellow"))
    parts += [_categories(report), _phases(report)]
    if report.modules:
        parts.append(_modules(report))
    peak = Text(f"peak {format_size(report.peak_bytes)}  ·  {report.bytes_per_parameter:.1f} bytes/param")
    parts.append(peak)
    if report.host_bytes is not None and report.devices is None:
        side = "beside the GPU's" if report.reserved_bytes is not None else "included in the peak (one memory on the CPU)"
        parts.append(Text(f"host RAM (offloaded shards, gradients, optimizer step): {format_size(report.host_bytes)}, "
                          f"{format_size(report.pinned_bytes or 0)} pinned; {side}"))
    if report.reserved_bytes is not None:
        parts.append(Text(f"{report.gpu}: {report.device_line()}"
                          + (f"; managed memory (paged optimizer state) {format_size(report.managed_bytes)} beside it"
                             if report.managed_bytes else "")))
    if report.verdict is not None:
        style = "bold red" if report.verdict == OOM else ("yellow" if report.tight or report.retries
                                                          or report.verdict == EXPANDABLE else "green")
        parts.append(Text(verdict_line(report), style=style))
        if report.tight:
            parts.append(Text(f"margin: {ERROR_SOURCE}", style="dim"))
    elif budget is not None:
        v = verdict(report, budget)
        word, style = ("fits", "green") if v["fits"] else ("does not fit", "bold red")
        what = "" if report.reserved_bytes is None else f"{format_size(v['needed_bytes'])} "
        parts.append(Text(f"{what}{word} in {format_size(budget)}: margin {format_size(v['margin_bytes'])}",
                          style=style))
    parts.extend(Text(f"note: {note}", style="dim") for note in report.notes)
    return Group(*parts)


def _generation(settings: dict) -> str:
    """One line of what a generation ran (``memfit.generation``)."""
    weights = "" if settings["weights"] == "auto" else f", {settings['weights']} weights"
    padded = ", left-padded" if settings["padding"] else ""
    return (f"generate {settings['batch_size']} x ({settings['prompt_len']} prompt + {settings['new_tokens']} new) "
            f"tokens{padded}, {settings['cache']} cache, {settings['precision']}{weights}")


def _devices(report: Report) -> Table:
    """One row per device of a ``device_map``: what is placed there and what it holds at its peak."""
    table = Table(title=f"device_map ({report.device_map['strategy']}): the figures below are the GPU that needs "
                        "the most", title_justify="left")
    for column in ("device", "modules", "parameters", "peak allocated", "on the device", "verdict"):
        table.add_column(column, justify="left" if column in ("device", "modules", "verdict") else "right")
    for row in report.devices:
        modules = row["modules"]
        placed = "" if not modules else modules[0] if len(modules) == 1 else f"{modules[0]} .. {modules[-1]} ({len(modules)})"
        need = row.get("device_bytes")
        table.add_row(row["device"], placed, format_size(row["by_category"].get(Category.PARAMETERS.value, 0)),
                      format_size(row["peak_bytes"]), "" if need is None else format_size(need),
                      row.get("verdict") or ("host RAM" if row["device"] == "cpu" else "offload folder"))
    return table


def _categories(report: Report) -> Table:
    table = Table(title="at the peak", title_justify="left")
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    table.add_column("bytes/param", justify="right")
    for cat, nbytes in sorted(report.by_category.items(), key=lambda kv: -kv[1]):
        if nbytes:
            table.add_row(cat, format_size(nbytes), f"{100 * nbytes / max(report.peak_bytes, 1):.1f}%",
                          f"{nbytes / max(report.parameters, 1):.2f}")
    if report.managed_bytes:  # outside the peak: torch's counters do not see it
        table.add_row("optimizer_state (managed, paged)", format_size(report.managed_bytes), "outside",
                      f"{report.managed_bytes / max(report.parameters, 1):.2f}")
    return table


def _phases(report: Report) -> Table:
    table = Table(title="phase peaks", title_justify="left")
    generation = [p for p in GENERATE_PHASES if p in report.phase_peaks]
    phases = generation or PHASES  # prefill and decode of a generation, else a step's three
    for phase in phases:
        table.add_column(phase, justify="right")
    table.add_row(*(format_size(report.phase_peaks.get(p, 0)) for p in phases))
    return table


def _modules(report: Report, top: int = 8) -> Table:
    table = Table(title="largest holders of activations and temporaries at the peak", title_justify="left")
    table.add_column("module")
    table.add_column("bytes", justify="right")
    for module, nbytes in report.modules[:top]:
        table.add_row(module, format_size(nbytes))
    return table


def plan_view(plans, name: str, out: str | None = None) -> Group:
    """The chosen plan, why, and the memory / speed front around it (``front_around``)."""
    best = plans.best
    where = plans.gpu or "this CPU"
    gpus, nodes = plans.settings.get("gpus"), plans.settings.get("nodes")
    if gpus:
        where = f"{where} x {gpus}" + (f" x {nodes} nodes" if nodes and nodes > 1 else "") + " (per rank)"
    head = Text(f"{name} on {where}: {best.recipe.describe()}", style="bold")
    speed = (f"{best.tokens_per_second:,.0f} tokens/s" if best.tokens_per_second is not None
             else f"{best.samples_per_second:,.2f} samples/s")
    reserved = "" if best.reserved_bytes is None else f", reserved {format_size(best.reserved_bytes)}"
    lines = [head,
             Text(f"needs {format_size(best.device_bytes)} of {format_size(plans.budget)} (full estimate: allocated "
                  f"{format_size(best.allocated_bytes)}{reserved}); predicted {best.step_seconds:.3g} s/step, {speed}")]
    if not best.recipe.is_exact:
        lines.append(Text(f"changes the math (allowed): {', '.join(best.recipe.approximations)}", style="yellow"))
    if best.alloc_conf:
        lines.append(Text(f"fits only with PYTORCH_CUDA_ALLOC_CONF={best.alloc_conf}: set it before training",
                          style="bold yellow"))
    lines.append(Text("why:"))
    lines += [Text(f"  - {reason}") for reason in best.reasons]
    table = Table(title=f"memory / speed front ({plans.candidates} candidates, {plans.seconds:.1f} s; predicted)",
                  title_justify="left")
    for column in ("needs", "s/step", "tokens/s" if best.tokens_per_second is not None else "samples/s", "recipe"):
        table.add_column(column, justify="left" if column == "recipe" else "right")
    rows, hidden = front_around(plans.front, best) if plans.front else (list(plans)[:8], max(0, len(plans) - 8))
    for p in rows:
        rate = p.tokens_per_second if p.tokens_per_second is not None else p.samples_per_second
        style = "bold green" if p.recipe == best.recipe else ("dim" if p.device_bytes > plans.budget else None)
        table.add_row(format_size(p.device_bytes), f"{p.step_seconds:.3g}", f"{rate:,.0f}", p.recipe.describe(),
                      style=style)
    lines.append(table)
    if hidden:
        lines.append(Text(f"{hidden} more on the front: --json lists them all", style="dim"))
    lines += [Text(f"note: {note}", style="dim") for note in plans.notes]
    if out:
        env = f"PYTORCH_CUDA_ALLOC_CONF={best.alloc_conf} " if best.alloc_conf else ""
        lines.append(Text(f"recipe written to {out} ({env}memfit estimate {name} --recipe {out})"))
    return Group(*lines)


def front_around(front: list, best, neighbours: int = NEIGHBOURS) -> tuple[list, int]:
    """The rows of the front worth reading: the chosen plan with up to ``neighbours`` smaller points
    before it and ``neighbours`` faster ones after it (the front runs smallest first, each point
    faster than every smaller one), and how many points of the front that leaves out.

    The choice is checked by a full estimate, so it may not be a point of the (predicted) front
    itself: then it is shown where its bytes put it.
    """
    at = next((i for i, p in enumerate(front) if p.recipe == best.recipe), None)
    if at is None:
        at = sum(p.device_bytes <= best.device_bytes for p in front)
        points = front[max(at - neighbours, 0):at + neighbours]
        rows = front[max(at - neighbours, 0):at] + [best] + front[at:at + neighbours]
    else:
        points = rows = front[max(at - neighbours, 0):at + neighbours + 1]
    return rows, len(front) - len(points)


def longest_view(found, name: str) -> Group:
    """The longest sequence at the micro-batch, its bytes against the budget, and what the next length needs."""
    where = found.gpu or "this CPU"
    rows = "row" if found.micro_batch_size == 1 else "rows"
    lines = [Text(f"{name} on {where}: {found.seq_len:,} tokens x {found.micro_batch_size} {rows} a micro-batch",
                  style="bold"), Text(f"recipe: {found.recipe.replace(micro_batch_size=None).describe()}")]
    reserved = "" if found.reserved_bytes is None else f", reserved {format_size(found.reserved_bytes)}"
    lines.append(Text(f"needs {format_size(found.device_bytes)} of {format_size(found.budget_bytes)} (allocated "
                      f"{format_size(found.allocated_bytes)}{reserved}): "
                      f"{format_size(found.budget_bytes - found.device_bytes)} to spare", style="green"))
    longer = found.seq_len + found.multiple
    if found.next_bytes is None:
        lines.append(Text(f"{longer:,} tokens not tried: the search stops there"))
    elif found.next_bytes <= found.budget_bytes:
        lines.append(Text(f"{longer:,} tokens would need {format_size(found.next_bytes)}, within the budget, but the "
                          "allocator's replay does not fit it (fragmentation, or only with expandable segments)"))
    else:
        lines.append(Text(f"{longer:,} tokens would need {format_size(found.next_bytes)}, "
                          f"{format_size(found.next_bytes - found.budget_bytes)} over"))
    lines.append(Text(f"checked by {found.estimates} full estimate(s), {found.seconds:.1f} s", style="dim"))
    lines += [Text(f"note: {note}", style="dim") for note in found.notes]
    return Group(*lines)


def fit_view(found, name: str) -> Group:
    """The largest micro-batch, its bytes against the budget, and what the next size up needs."""
    where = found.gpu or "this CPU"
    ranks = f" x {found.ranks} ranks" if getattr(found, "ranks", 1) > 1 else ""
    head = Text(f"{name} on {where}: micro-batch {found.micro_batch_size} x {found.grad_accum_steps} accumulation"
                f"{ranks} = global batch {found.global_batch_size}", style="bold")
    lines = [head, Text(f"recipe: {found.recipe.replace(micro_batch_size=None).describe()}")]
    reserved = "" if found.reserved_bytes is None else f", reserved {format_size(found.reserved_bytes)}"
    spare = format_size(found.budget_bytes - found.device_bytes)
    lines.append(Text(f"needs {format_size(found.device_bytes)} of {format_size(found.budget_bytes)} (allocated "
                      f"{format_size(found.allocated_bytes)}{reserved}): {spare} to spare", style="green"))
    if found.next_bytes is None:
        lines.append(Text(f"micro-batch {found.micro_batch_size + 1} not tried: the search stops there"))
    elif found.next_bytes <= found.budget_bytes:  # under the budget, but torch's allocator (replayed) runs out
        lines.append(Text(f"micro-batch {found.micro_batch_size + 1} would need {format_size(found.next_bytes)}, "
                          "within the budget, but the allocator's replay does not fit it (fragmentation, or only "
                          "with expandable segments)"))
    else:
        lines.append(Text(f"micro-batch {found.micro_batch_size + 1} would need {format_size(found.next_bytes)}, "
                          f"{format_size(found.next_bytes - found.budget_bytes)} over"))
    if found.tokens_per_step is not None:
        lines.append(Text(f"{found.tokens_per_step:,} tokens per optimizer step"))
    predicted = ("" if found.predicted_micro_batch_size is None
                 else f"; composed prediction {found.predicted_micro_batch_size} from {found.traces} traces")
    lines.append(Text(f"checked by {found.estimates} full estimate(s){predicted}, {found.seconds:.1f} s", style="dim"))
    lines += [Text(f"note: {note}", style="dim") for note in found.notes]
    return Group(*lines)
