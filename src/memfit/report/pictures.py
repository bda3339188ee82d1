"""Pictures of a ``Report``: an interactive HTML page and a PNG.

``write_html`` writes one self-contained page: memory over time stacked by category, with the
phases shaded and the steps labelled, the peak marked, the allocator's reserved bytes beside the
allocated ones (a CUDA profile), another report's total drawn over it (``estimate=``: the estimate's
curve over the measured one), the modules holding the most at the peak, and the tables a profile
brings (the largest allocations at the peak with their Python stacks, the leaks). ``write_png``
draws the timeline and the module bars as one 1600x900 picture. Both use one colour per
:class:`~memfit.Category` (``COLOURS``).

Why these libraries: plotly writes a page that zooms and shows every category's bytes under the
mouse, with its one JavaScript bundle inlined (``include_plotlyjs=True``, about 4.6 MB), so the file
opens anywhere with no server and no network. Its own PNG export (kaleido) needs a Chrome at run time,
so the PNG is matplotlib's, drawn on a ``Figure`` with its own Agg canvas (no display, no browser, and
none of pyplot's global state left behind). Both are imported only when a picture is
drawn (``pip install 'memfit[pictures]'``); the rest of memfit never needs them.

Written by hand: the alignment and the tables. Two runs of one step (an estimate and a measurement)
have different event counts, so neither draws on event numbers: each point stands at
``step + its position inside its (step, phase) segment``, each step being 1 wide and shared between
its phases in proportion to their events (``_timeline.py``, which both pictures draw from). The HTML
tables are plain markup (no script), with each stack folded in a ``<details>``.

Left out: the per-rank and per-device figures of parallel and device-map reports (a picture draws the
one timeline the report has), and from the PNG the allocation and leak tables (stacks need the page).
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from memfit.categories import Category
from memfit.errors import MemfitError
from memfit.report._timeline import Timeline, timeline, unit
from memfit.report.report import Report
from memfit.units import format_size

__all__ = ["write_html", "write_png", "require", "COLOURS"]

# One colour per category, the same in the HTML and the PNG (colour-blind-safe hues where they matter:
# the four big categories are blue, orange, red and green).
COLOURS = {
    Category.PARAMETERS.value: "#4c72b0",
    Category.BUFFERS.value: "#8c8c8c",
    Category.GRADIENTS.value: "#dd8452",
    Category.OPTIMIZER_STATE.value: "#c44e52",
    Category.ACTIVATIONS.value: "#55a868",
    Category.TEMPORARIES.value: "#ccb974",
    Category.BATCH.value: "#8172b3",
    Category.UNSHARDED_PARAMETERS.value: "#64b5cd",
    Category.UNSHARDED_GRADIENTS.value: "#da8bc3",
    Category.COMMUNICATION.value: "#937860",
    Category.KV_CACHE.value: "#17becf",
}
OTHER_COLOUR = "#7f7f7f"
PHASE_COLOURS = {"setup": "#eeeeee", "forward": "#dbe8f7", "backward": "#fbe6d4", "optimizer": "#e9dff5",
                 "after": "#f4f4f4"}
PHASE_SHORT = {"setup": "setup", "forward": "fwd", "backward": "bwd", "optimizer": "opt",
               "after": "(after the last step)"}
ESTIMATE_COLOUR, RESERVED_COLOUR = "#111111", "#8b0000"
TOP_MODULES = 15
X_TITLE = ("step (each step's phases stretched to [step, step+1): runs with different event counts align by step "
           "and phase)")
INSTALL = "pictures need plotly and matplotlib: pip install 'memfit[pictures]'"


def _colour(name: str) -> str:
    return COLOURS.get(name, OTHER_COLOUR)


METHODS = {"fake": "estimated on fake tensors", "depth": "estimated on fake tensors, scaled by depth",
           "measured": "measured"}


def _summary(report: Report) -> str:
    """What was run: "fp32, adamw, batch 1x32, estimated on fake tensors"."""
    settings = report.settings or {}
    parts = [settings.get("precision"), settings.get("optimizer")]
    shapes = settings.get("batch_shapes") or []
    if shapes and isinstance(shapes[0], (list, tuple)):
        parts.append("batch " + "x".join(str(n) for n in shapes[0]))
    parts.append(METHODS.get(report.method, report.method))
    return ", ".join(str(p) for p in parts if p)


def _title(report: Report, title: str | None) -> str:
    return title or f"memfit: {_summary(report)}"


def _subtitle(report: Report, title: str | None) -> list[str]:
    """The lines under the title: what was run (when the title does not say it), then the headline."""
    return ([_summary(report)] if title else []) + report._headline()


def require() -> None:
    """Raise the install hint unless plotly and matplotlib can be imported (nothing is imported: the CLI
    asks before a long estimate)."""
    from importlib.util import find_spec

    if find_spec("plotly") is None or find_spec("matplotlib") is None:
        raise MemfitError(INSTALL)


# ---------------------------------------------------------------------------------------------- HTML

def _plotly():
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise MemfitError(INSTALL) from None
    return go


def write_html(report: Report, path, *, estimate: Report | None = None, title: str | None = None) -> Path:
    """Write ``report`` as one self-contained interactive page (plotly inlined); ``estimate``, another
    report of the same step, is drawn as a line over it. Returns the path written."""
    go = _plotly()
    plot = timeline(report, estimate)
    graphs = _timeline_figure(go, plot, estimate).to_html(full_html=False, include_plotlyjs=True,
                                                           div_id="memfit-timeline")
    if report.modules:
        graphs += _modules_figure(go, report).to_html(full_html=False, include_plotlyjs=False,
                                                       div_id="memfit-modules")
    body = _header(report, title) + graphs + _allocations(report) + _leaks(report)
    path = Path(path)
    path.write_text(PAGE.format(title=escape(_title(report, title)), body=body), encoding="utf-8")
    return path


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; padding: 0 1.5em; max-width: 1400px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.8em 0 1.6em; font-size: 0.92em; }}
th, td {{ padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; vertical-align: top; }}
td.n, th.n {{ text-align: right; white-space: nowrap; }}
caption {{ text-align: left; font-weight: bold; padding-bottom: 0.3em; }}
.swatch {{ display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em; vertical-align: -0.1em; }}
pre {{ margin: 0.3em 0; font-size: 0.9em; }}
.note {{ color: #555; font-style: italic; }}
</style></head>
<body>{body}</body></html>
"""


def _timeline_figure(go, plot: Timeline, estimate: Report | None):
    fig = go.Figure()
    _add_curves(go, fig, plot, estimate)
    for x0, x1, phase in plot.bands:
        fig.add_vrect(x0=x0, x1=x1, fillcolor=PHASE_COLOURS.get(phase, "#f5f5f5"), line_width=0, layer="below")
        if x1 - x0 > 0.07:
            fig.add_annotation(x=(x0 + x1) / 2, y=0.995, yref="paper", text=PHASE_SHORT.get(phase, phase),
                               showarrow=False, yanchor="top", font=dict(size=11, color="#666"))
    for x0, x1, label in plot.steps:
        fig.add_vline(x=x0, line=dict(color="#999", width=1, dash="dot"))
        fig.add_annotation(x=(x0 + x1) / 2, y=1.0, yref="paper", text=f"<b>{label}</b>", showarrow=False,
                           yanchor="bottom")
    starts = [x0 for x0, _, _ in plot.steps]
    fig.update_layout(title="live memory over the step, by category", hovermode="x unified",
                      template="plotly_white", height=560, margin=dict(t=80, r=20),
                      legend=dict(x=1.01, y=1, traceorder="reversed"),
                      xaxis=dict(title=dict(text=X_TITLE, font=dict(size=12)), showgrid=False, zeroline=False,
                                 tickvals=starts, ticktext=[""] * len(starts), hoverformat=".3f"),
                      yaxis=dict(title=f"live memory ({plot.unit[0]})", rangemode="tozero"))
    return fig


def _add_curves(go, fig, plot: Timeline, estimate: Report | None) -> None:
    """The stacked categories (the top one says where the point is), the estimate, reserved and the peak."""
    unit_name, scale = plot.unit
    last = list(plot.series)[-1:]
    for name, values in plot.series.items():
        where = "%{text}<br>" if [name] == last else ""
        fig.add_trace(go.Scatter(
            x=plot.x, y=[v / scale for v in values], name=name, mode="lines", stackgroup="live",
            line=dict(width=0.5, color=_colour(name)), fillcolor=_colour(name), text=plot.where,
            hovertemplate=f"{where}{name}: %{{y:.3f}} {unit_name}<extra></extra>"))
    lines = [(plot.estimate, f"estimate total ({estimate.method})" if estimate else "", ESTIMATE_COLOUR, "dot"),
             (plot.reserved, "reserved (allocator)", RESERVED_COLOUR, "dash")]
    for line, label, colour, dash in lines:
        if line is not None:
            fig.add_trace(go.Scatter(x=line[0], y=[v / scale for v in line[1]], name=label, mode="lines",
                                     line=dict(color=colour, width=2, dash=dash),
                                     hovertemplate=f"{label}: %{{y:.3f}} {unit_name}<extra></extra>"))
    x, peak = plot.peak
    fig.add_trace(go.Scatter(x=[x], y=[peak / scale], name=f"peak {format_size(peak)}", mode="markers",
                             marker=dict(symbol="star", size=14, color="black"), cliponaxis=False,
                             hovertemplate=f"peak {format_size(peak)}<extra></extra>"))


def _modules_figure(go, report: Report):
    rows = report.modules[:TOP_MODULES][::-1]
    unit_name, scale = unit(rows[-1][1])
    fig = go.Figure(go.Bar(
        x=[n / scale for _, n in rows], y=[name for name, _ in rows], orientation="h",
        marker_color=COLOURS[Category.ACTIVATIONS.value], text=[format_size(n) for _, n in rows],
        textposition="auto", hovertemplate="%{y}: %{text}<extra></extra>"))
    fig.update_layout(title=f"activations and temporaries live at the peak, by the module that made them "
                            f"(top {len(rows)})", template="plotly_white",
                      height=140 + 26 * len(rows), margin=dict(l=20, r=20, t=60),
                      xaxis=dict(title=f"bytes ({unit_name})"), yaxis=dict(automargin=True))
    return fig


def _header(report: Report, title: str | None) -> str:
    parts = [f"<h1>{escape(_title(report, title))}</h1>"]
    parts += [f"<p>{escape(line)}</p>" for line in _subtitle(report, title)]
    peak = max(report.peak_bytes, 1)
    rows = "".join(f'<tr><td><span class="swatch" style="background:{_colour(name)}"></span>{escape(name)}</td>'
                   f'<td class="n">{format_size(n)}</td><td class="n">{100 * n / peak:.1f}%</td></tr>'
                   for name, n in report._categories())
    parts.append('<table><caption>at the peak</caption><thead><tr><th>category</th><th class="n">bytes</th>'
                 f'<th class="n">share</th></tr></thead><tbody>{rows}</tbody></table>')
    parts += [f'<p class="note">note: {escape(note)}</p>' for note in report.notes]
    return "".join(parts)


def _stack(frames) -> str:
    frames = list(frames or [])
    if not frames:
        return ""
    return (f"<details><summary>{escape(frames[0])}</summary><pre>"
            + escape("\n".join(frames)) + "</pre></details>")


def _rows_table(caption: str, head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A table whose cells are markup already; the columns named in ``NUMERIC`` right-aligned."""
    cls = ['class="n"' if h in NUMERIC else "" for h in head]
    th = "".join(f"<th {c}>{escape(h)}</th>" for c, h in zip(cls, head))
    body = "".join("<tr>" + "".join(f"<td {c}>{cell}</td>" for c, cell in zip(cls, row)) + "</tr>" for row in rows)
    return f"<table><caption>{escape(caption)}</caption><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


NUMERIC = {"bytes", "bytes/step", "steps"}


def _allocations(report: Report) -> str:
    if not report.top_allocations:
        return ""
    rows = [(format_size(a["bytes"]), escape(str(a.get("category", ""))), escape(str(a.get("module", ""))),
             escape(str(a.get("site", ""))), _stack(a.get("stack"))) for a in report.top_allocations]
    return _rows_table("largest live allocations at the peak (stack innermost first)",
                       ("bytes", "category", "module", "site", "stack"), rows)


def _leaks(report: Report) -> str:
    if not report.leaks:
        return ""
    rows = [(escape(str(leak.get("site", ""))), format_size(leak["bytes_per_step"]), str(leak.get("steps", "")),
             escape(str(leak.get("category", ""))), _stack(leak.get("stack"))) for leak in report.leaks]
    return _rows_table("memory that grows from step to step (leaks)",
                       ("site", "bytes/step", "steps", "category", "stack"), rows)


# ----------------------------------------------------------------------------------------------- PNG

def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MemfitError(INSTALL) from None
    return Figure, FigureCanvasAgg


def write_png(report: Report, path, *, estimate: Report | None = None, title: str | None = None) -> Path:
    """Write ``report``'s timeline (with ``estimate``'s total over it) and its module bars as a
    1600x900 PNG, drawn off-screen (Agg). Returns the path written."""
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(16, 9), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 2, width_ratios=(2.2, 1), left=0.055, right=0.985, top=0.85, bottom=0.17,
                            wspace=0.38)
    _draw_timeline(fig.add_subplot(grid[0]), timeline(report, estimate), estimate)
    _draw_modules(fig.add_subplot(grid[1]), report)
    fig.suptitle(_title(report, title), x=0.055, ha="left", fontsize=17, fontweight="bold")
    fig.text(0.055, 0.935, "\n".join(_subtitle(report, title)[:2]), fontsize=11, color="#444", va="top")
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def _draw_timeline(ax, plot: Timeline, estimate: Report | None) -> None:
    unit_name, scale = plot.unit
    _draw_bands(ax, plot)
    if plot.series:
        ax.stackplot(plot.x, *[[v / scale for v in values] for values in plot.series.values()],
                     colors=[_colour(name) for name in plot.series], labels=list(plot.series), lw=0, zorder=2)
    if plot.estimate is not None:
        x, y = plot.estimate
        ax.plot(x, [v / scale for v in y], color=ESTIMATE_COLOUR, lw=2, ls=(0, (2, 1.5)), zorder=3,
                label=f"estimate total ({estimate.method})")
    if plot.reserved is not None:
        x, y = plot.reserved
        ax.plot(x, [v / scale for v in y], color=RESERVED_COLOUR, lw=1.5, ls="--", zorder=3,
                label="reserved (allocator)")
    x, peak = plot.peak
    ax.plot([x], [peak / scale], marker="*", ms=15, color="black", ls="none", zorder=4,
            label=f"peak {format_size(peak)}")
    ax.set_ylim(0, max(plot.top, 1) / scale * 1.12)  # room for the phase names
    ax.set_ylabel(f"live memory ({unit_name})", fontsize=12)
    ax.set_xlabel("step (each step's phases stretched to [step, step+1), aligned by step and phase)", fontsize=11)
    ax.grid(axis="y", color="white", lw=0.8, alpha=0.7, zorder=2.5)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=5, fontsize=11,
              frameon=False)


def _draw_bands(ax, plot: Timeline) -> None:
    """The phases shaded and named, the steps named above the plot, their boundaries dotted."""
    top = ax.get_xaxis_transform()  # x in data, y in axes
    for x0, x1, phase in plot.bands:
        ax.axvspan(x0, x1, color=PHASE_COLOURS.get(phase, "#f5f5f5"), lw=0, zorder=0)
        if x1 - x0 > 0.07:
            ax.text((x0 + x1) / 2, 0.985, PHASE_SHORT.get(phase, phase), transform=top, ha="center", va="top",
                    fontsize=10, color="#555")
    for x0, x1, label in plot.steps:
        ax.axvline(x0, color="#888", lw=1, ls=":", zorder=1)
        ax.text((x0 + x1) / 2, 1.01, label, transform=top, ha="center", va="bottom", fontsize=12, fontweight="bold")
    ax.set_xlim(plot.bands[0][0] if plot.bands else 0, plot.bands[-1][1] if plot.bands else 1)
    ax.set_xticks([x0 for x0, _, _ in plot.steps if x0 >= 0], [])  # the steps are named above the plot
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_modules(ax, report: Report) -> None:
    rows = report.modules[:TOP_MODULES][::-1]
    ax.set_title("activations and temporaries at the peak,\nby the module that made them", fontsize=12, loc="left")
    if not rows:
        ax.text(0.5, 0.5, "no module figures in this report", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    unit_name, scale = unit(rows[-1][1])
    values = [n / scale for _, n in rows]
    slots = max(len(rows), 10)  # a few modules get thin bars at the top, not fat ones
    ys = range(slots - len(rows), slots)
    ax.barh(ys, values, color=COLOURS[Category.ACTIVATIONS.value])
    ax.set_yticks(ys, [_short(name) for name, _ in rows], fontsize=10)
    ax.set_ylim(-0.6, slots - 0.4)
    for y, value, (_, n) in zip(ys, values, rows):
        ax.text(value, y, f" {format_size(n)}", va="center", fontsize=9)
    ax.set_xlim(0, (max(values) or 1) * 1.3)  # room for the figures
    ax.set_xlabel(f"bytes ({unit_name})", fontsize=11)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _short(name: str, limit: int = 34) -> str:
    """A module path cut from the left, a whole name at a time (the innermost names say most)."""
    if len(name) <= limit:
        return name
    parts = name.split(".")
    while len(parts) > 1 and len(".".join(parts)) > limit - 1:
        parts.pop(0)
    return "…" + ".".join(parts)[-(limit - 1):]
