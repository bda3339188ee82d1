"""``memfit models`` and ``memfit gpus``: the two catalogs, as a table or JSON."""

from __future__ import annotations

import json

from memfit.cli import _args


def build_models(parser) -> None:
    filters = _args.section(parser, "filters")
    filters.add_argument("--family", metavar="NAME",
                         help="only this family (a prefix: qwen matches qwen2, qwen3 and qwen3.5)")
    filters.add_argument("--max-params", metavar="N",
                         help="only models of at most N parameters, e.g. 10B, 500M or 7e9 (total, not active)")
    _args.section(parser, "output").add_argument("--json", action="store_true", help="print the list as JSON")


def build_gpus(parser) -> None:  # the models' filters are theirs only
    _args.section(parser, "output").add_argument("--json", action="store_true", help="print the list as JSON")


def models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from memfit.errors import MemfitError
    from memfit.models.catalog import CATALOG
    from memfit.models.counts import Counts, format_count, parse_count, table

    stored, family = table(), (args.family or "").strip().lower()
    counts = {name: stored.get(name, Counts(None, None)) for name in CATALOG}  # None: table not regenerated
    most = parse_count(args.max_params) if args.max_params is not None else None
    chosen = {name: entry for name, entry in CATALOG.items() if entry.family.lower().startswith(family)
              and (most is None or (counts[name].params is not None and counts[name].params <= most))}
    if not chosen and family and not any(e.family.lower().startswith(family) for e in CATALOG.values()):
        raise MemfitError(f"no catalog family {args.family!r}: use one of "
                          f"{', '.join(sorted({e.family for e in CATALOG.values()}))}")
    if args.json:
        print(json.dumps({k: {"model_type": v.model_type, "task": v.task, "family": v.family, "source": v.source,
                              "params": counts[k].params, "active_params": counts[k].active, **v.config}
                          for k, v in chosen.items()}, indent=2))
        return 0
    # no borders and one space between columns: six columns in 80 (active: per token, MoE only)
    rows = Table("name", "family", "type", "params", "active", "task", box=None, padding=(0, 1, 0, 0),
                 pad_edge=False, header_style="bold")
    for column in (rows.columns[3], rows.columns[4]):
        column.justify = "right"
    for name, entry in chosen.items():
        rows.add_row(name, entry.family, entry.model_type, format_count(counts[name].params),
                     format_count(counts[name].active), entry.task)
    Console().print(rows)
    return 0


def gpus(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from memfit.hardware.gpus import CATALOG

    if args.json:
        print(json.dumps([g.to_dict() for g in CATALOG.values()], indent=2))
        return 0
    # units in two-line headers so the table fits 80 columns; bf16 "-": the card has no bf16
    table = Table(title="GPU catalog: NVIDIA (CUDA), AMD (ROCm), Macs (MPS: memory is RAM)",
                  title_justify="left")
    link = "host link\n(x16)"
    for column in ("name", "memory", "compute", "bf16 dense\nTFLOPS", "memory\nTB/s", link, "host\nGB/s"):
        table.add_column(column, justify="left" if column in ("name", link) else "right", no_wrap=column == "name")
    for g in CATALOG.values():
        compute = {"nvidia": "%d.%d" % g.compute_capability, "amd": g.arch, "apple": "MPS"}[g.vendor]
        table.add_row(g.name, f"{g.memory_bytes / 2**30:.1f} GiB", compute,
                      f"{g.bf16_flops / 1e12:.0f}" if g.bf16 else "-", f"{g.memory_bandwidth / 1e12:.2f}",
                      "unified" if g.vendor == "apple" else g.host_link.replace(" x16", ""),
                      f"{g.host_link_bandwidth / 1e9:.0f}")
    Console().print(table)
    print("sources: memfit/hardware/gpus.py (NVIDIA), amd.py (AMD), macs.py (Apple);")
    print("each card's in short: memfit gpus --json (its source field)")
    return 0
