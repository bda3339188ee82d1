"""``memfit serve-plan``: requests x context a serving process holds on a card, per weight format,
beside vLLM's block arithmetic and the analytic KV formula (``generation/serve.py``)."""

from __future__ import annotations

import json

from memfit.cli import _args


def _fraction(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        from memfit.errors import shown

        raise argparse.ArgumentTypeError(f"{shown(text)} is not a fraction in (0, 1]")
    return value


def build(parser) -> None:
    parser.usage = "%(prog)s MODEL --context N [--gpu CARD] [flags]"
    _args.add_model(parser)
    _args.add_gpu(parser, help="a catalog card (default h100-sxm; see memfit gpus)", default="h100-sxm")
    _args.add_budget(parser, help="the card's memory instead of the catalog's, e.g. 12GiB")
    _args.section(parser, "parallel").add_argument(
        "--gpus", type=_args.positive, default=1, metavar="N",
        help="cards of --gpu (default 1): a model too big for one is placed over them (device_map; no TP)")
    serving = _args.section(parser, "serving")
    serving.add_argument("--context", type=_args.tokens, required=True, metavar="N",
                         help="tokens per request, prompt + output, e.g. 8192")
    serving.add_argument("--chunk", type=_args.positive, action="append", default=None, metavar="N",
                         help="prefill chunk size to try (repeatable; default 512, 2048, 8192): smaller leaves more cache")
    serving.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="X",
                         help="vLLM's share of the card for its block arithmetic (default 0.9)")
    serving.add_argument("--block-size", type=_args.positive, default=16, metavar="N",
                         help="vLLM's tokens per KV block (default 16)")
    serving.add_argument("--max-num-batched-tokens", type=_args.positive, default=None, metavar="N",
                         help="vLLM's profile-run tokens (default as vllm serve: 8192 on 70 GiB+ cards but A100, else 2048)")
    _args.section(parser, "planning").add_argument(
        "--allow", default="", metavar="FORMATS", help="weight formats beside bf16 (default: exact only): int8, nf4 "
        "or int8,nf4")
    _args.add_json(parser, help="print the plan as JSON")


def run(args) -> int:
    from memfit.generation.serve import serve_plan

    with _args.progress(f"tracing {args.model}'s generate on fake tensors"):
        plan = serve_plan(_args.model_of(args), gpu=args.gpu, context=args.context, gpus=args.gpus,
                          chunks=args.chunk, allow=args.allow, gpu_memory_utilization=args.gpu_memory_utilization,
                          block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                          budget=args.budget)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        show(plan)
    return 0


def show(plan) -> None:
    from rich.console import Console
    from rich.table import Table

    from memfit.units import format_size

    console = Console()
    console.print(f"{plan.model} on {plan.gpu}, {plan.context} tokens per request: {format_size(plan.usable_bytes)} "
                  "usable")
    table = Table("format", "weights", "KV/request", "max batch", "max context", "chunk", "chunk peak",
                  box=None, padding=(0, 1, 0, 0))
    for row in plan.formats:
        mark = " *" if row.format == plan.chosen else ""
        table.add_row(row.format + mark, format_size(row.weights_bytes), format_size(row.kv_bytes_per_request),
                      str(row.max_batch), str(row.max_context), str(row.chunk), format_size(row.chunk_bytes))
    console.print(table)
    console.print(f"chosen: {plan.reason}")
    vllm, formula = plan.vllm, plan.analytic
    chosen = next((r for r in plan.formats if r.format == plan.chosen), None)
    side = Table("", "max batch", "weights", "KV pool / need", box=None, padding=(0, 1, 0, 0))
    if chosen is not None:
        side.add_row("memfit", str(chosen.max_batch), format_size(chosen.weights_bytes), format_size(chosen.need_bytes))
    side.add_row(f"vLLM x{vllm['gpu_memory_utilization']:g}", str(vllm["max_concurrency"]),
                 format_size(vllm["weights_bytes"]),
                 f"{vllm['num_blocks']} blocks of {vllm['block_size']} ({format_size(vllm['available_kv_bytes'])})")
    side.add_row("formula", str(formula["max_batch"]), format_size(formula["weights_bytes"]),
                 f"{format_size(formula['kv_bytes_per_request'])}/request")
    console.print(side)
    console.print(f"KV per token: traced {plan.kv_measured_per_token} B, formula {plan.kv_analytic_per_token} B")
    console.print(f"vLLM: {vllm['max_num_batched_tokens']}-token profile run, peak "
                  f"{format_size(vllm['profile_peak_bytes'])}; {vllm['blocks_per_request']} blocks a request")
    if plan.placement:
        for device in plan.placement.get("devices", []):
            console.print(f"  {device['device']}: {format_size(device['bytes'])}")
    for note in plan.notes:
        console.print(f"note: {note}")
