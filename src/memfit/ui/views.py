"""The page's text: an estimate, a plan, its emitted configs and a serving plan as Markdown, and the
categories as rows. The same lines the command line prints (``report/tables.py``,
``cli/serve_plan.py``), with the same words and sizes (``memfit.units.format_size``), in Markdown
instead of rich's tables; nothing here computes a number the answer does not hold.
"""

from __future__ import annotations

import re

from memfit.errors import MemfitError
from memfit.units import format_size

__all__ = ["md", "error_line", "estimate_text", "size_rows", "plan_text", "configs_text", "serve_text", "SIZE_HEADERS"]

SIZE_HEADERS = ["category", "size", "bytes", "share"]
_SPECIAL = re.compile(r"([\\`*_\[\]<>#|~])")
STAR = " \\*"  # the chosen format's mark, as `memfit serve-plan` marks it
_LANGUAGES = {".yaml": "yaml", ".yml": "yaml", ".json": "json", ".py": "python", ".sh": "shell", ".toml": "toml"}


def md(text) -> str:
    """``text`` shown as written: Markdown's special characters escaped."""
    return _SPECIAL.sub(r"\\\1", str(text))


def error_line(err: Exception) -> str:
    """The one line the page shows for an error (a MemfitError is one line already)."""
    return "**error:** " + md(MemfitError(str(err)))


def estimate_text(report, name: str, recipe) -> str:
    """The verdict first (the first line of ``memfit estimate``), then what ran and the device's bytes."""
    from memfit.report.report import target_line, verdict_line

    lines = [f"{md(name)}: {md(recipe.describe())}, {report.parameters / 1e9:.3f}B params "
             f"({md(report.method)} on {md(report.device)} semantics); peak {format_size(report.peak_bytes)}, "
             f"{report.bytes_per_parameter:.1f} bytes/param"]
    if report.reserved_bytes is not None:
        lines.append(f"{md(report.gpu)}: {md(report.device_line())}")
    if report.verdict is not None:
        lines.append(f"**{md(verdict_line(report))}**")
    if not recipe.is_exact:
        lines.append(f"changes the math: {md(', '.join(recipe.approximations))}")
    notes = "  \n".join(f"*note: {md(note)}*" for note in report.notes)
    return f"### {md(target_line(report))}\n\n" + "  \n".join(lines) + (f"\n\n{notes}" if notes else "")


def size_rows(report) -> list[list]:
    """The categories at the peak, largest first: name, size, bytes, share of the peak."""
    peak = max(report.peak_bytes, 1)
    rows = sorted(((name, n) for name, n in report.by_category.items() if n), key=lambda kv: -kv[1])
    return [[name, format_size(n), n, f"{100 * n / peak:.1f}%"] for name, n in rows]


def plan_text(plans, name: str) -> str:
    """The chosen recipe, its bytes and speed, why, and the memory / speed front around it."""
    best = plans.best
    speed = (f"{best.tokens_per_second:,.0f} tokens/s" if best.tokens_per_second is not None
             else f"{best.samples_per_second:,.2f} samples/s")
    reserved = "" if best.reserved_bytes is None else f", reserved {format_size(best.reserved_bytes)}"
    lines = [f"### {md(name)} on {md(plans.gpu or 'this CPU')}: {md(best.recipe.describe())}",
             f"needs {format_size(best.device_bytes)} of {format_size(plans.budget)} (full estimate: allocated "
             f"{format_size(best.allocated_bytes)}{reserved}); predicted {best.step_seconds:.3g} s/step, {speed}"]
    if not best.recipe.is_exact:
        lines.append(f"changes the math (allowed): {md(', '.join(best.recipe.approximations))}")
    if best.alloc_conf:
        lines.append(f"**fits only with PYTORCH\\_CUDA\\_ALLOC\\_CONF={md(best.alloc_conf)}: set it before training**")
    lines.append("**why:**\n\n" + "\n".join(f"- {md(reason)}" for reason in best.reasons))
    lines.append(_front(plans))
    lines += [f"*note: {md(note)}*" for note in plans.notes]
    return "\n\n".join(lines)


def _front(plans) -> str:
    """The memory / speed front around the chosen plan (``front_around``), the chosen row in bold."""
    from memfit.report.tables import front_around

    best = plans.best
    rate = "tokens/s" if best.tokens_per_second is not None else "samples/s"
    table = [f"memory / speed front ({plans.candidates} candidates, {plans.seconds:.1f} s; predicted)\n",
             f"| needs | s/step | {rate} | recipe |", "|---:|---:|---:|:---|"]
    rows, hidden = front_around(plans.front, best) if plans.front else (list(plans)[:8], 0)
    for p in rows:
        value = p.tokens_per_second if p.tokens_per_second is not None else p.samples_per_second
        mark = "**" if p.recipe == best.recipe else ""
        table.append(f"| {mark}{format_size(p.device_bytes)}{mark} | {p.step_seconds:.3g} | {value:,.0f} | "
                     f"{mark}{md(p.recipe.describe())}{mark} |")
    more = f"\n\n{hidden} more on the front: `memfit plan --json` lists them all" if hidden else ""
    return "\n".join(table) + more


def configs_text(plans, model: str | None, seq_len: int | None) -> str:
    """The chosen recipe written as each trainer's config (``memfit.trainers.emit``): a code block each,
    with what the tool cannot express and how to launch it; a tool that refuses the recipe says why."""
    try:
        from memfit.trainers.emit import TOOLS, emit
    except ModuleNotFoundError as err:
        if err.name != "memfit.trainers.emit":
            raise
        return error_line(MemfitError("this memfit has no config writer (memfit.trainers.emit): the configs "
                                      "come with a later version; the plan's recipe is on the plan tab"))
    recipe, parts = plans.best.recipe, []
    # a ds_config.json is a ZeRO recipe's (parallel=zero1-3); the other tools write any recipe
    for tool in (t for t in TOOLS if t != "deepspeed" or str(recipe.parallel).startswith("zero")):
        try:
            out = emit(recipe, tool, gpus=1, nodes=1, seq_len=seq_len or plans.best.seq_len, model=model)
        except MemfitError as err:
            parts.append(f"#### {md(tool)}\n\n{error_line(err)}")
            continue
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", out.text)), default=0))
        language = next((lang for end, lang in _LANGUAGES.items() if out.filename.endswith(end)), "")
        notes = "".join(f"\n- {md(note)}" for note in out.notes)
        parts.append(f"#### {md(out.tool)}: `{out.filename}`\n\n{fence}{language}\n{out.text.rstrip()}\n{fence}\n"
                     + notes)
    return "\n\n".join(parts)


def serve_text(plan, name: str) -> str:
    """Requests x context per weight format, the chosen one and why, beside vLLM's blocks and the formula."""
    vllm = plan.vllm
    lines = [f"### {md(name)} on {md(plan.gpu)}, {plan.context} tokens per request: "
             f"{format_size(plan.usable_bytes)} usable", _formats(plan), f"**chosen:** {md(plan.reason)}",
             _beside(plan),
             f"KV per token: traced {plan.kv_measured_per_token} B, formula {plan.kv_analytic_per_token} B",
             f"vLLM: {vllm['max_num_batched_tokens']}-token profile run, peak "
             f"{format_size(vllm['profile_peak_bytes'])}; {vllm['blocks_per_request']} blocks a request"]
    if plan.placement:
        lines.append("\n".join(f"- {md(d['device'])}: {format_size(d['bytes'])}"
                               for d in plan.placement.get("devices", [])))
    lines += [f"*note: {md(note)}*" for note in plan.notes]
    return "\n\n".join(lines)


def _formats(plan) -> str:
    """One row per weight format; the one served marked."""
    rows = ["| format | weights | KV/request | max batch | max context | chunk | chunk peak |",
            "|:---|---:|---:|---:|---:|---:|---:|"]
    for r in plan.formats:
        rows.append(f"| {md(r.format)}{STAR if r.format == plan.chosen else ''} | {format_size(r.weights_bytes)} | "
                    f"{format_size(r.kv_bytes_per_request)} | {r.max_batch} | {r.max_context} | {r.chunk} | "
                    f"{format_size(r.chunk_bytes)} |")
    return "\n".join(rows)


def _beside(plan) -> str:
    """memfit's chosen format beside vLLM's block arithmetic and the analytic formula."""
    vllm, formula = plan.vllm, plan.analytic
    rows = ["| | max batch | weights | KV pool / need |", "|:---|---:|---:|:---|"]
    chosen = next((r for r in plan.formats if r.format == plan.chosen), None)
    if chosen is not None:
        rows.append(f"| memfit | {chosen.max_batch} | {format_size(chosen.weights_bytes)} | "
                    f"{format_size(chosen.need_bytes)} |")
    rows.append(f"| vLLM x{vllm['gpu_memory_utilization']:g} | {vllm['max_concurrency']} | "
                f"{format_size(vllm['weights_bytes'])} | {vllm['num_blocks']} blocks of {vllm['block_size']} "
                f"({format_size(vllm['available_kv_bytes'])}) |")
    rows.append(f"| formula | {formula['max_batch']} | {format_size(formula['weights_bytes'])} | "
                f"{format_size(formula['kv_bytes_per_request'])}/request |")
    return "\n".join(rows)
