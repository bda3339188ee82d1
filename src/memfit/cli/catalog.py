"""``memfit models`` and ``memfit gpus``: the two catalogs, as a table or JSON."""

from __future__ import annotations

import json


def build_models(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the list as JSON")


build_gpus = build_models


def models(args) -> int:
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


def gpus(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from memfit.hardware.gpus import CATALOG
    from memfit.units import format_size

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
