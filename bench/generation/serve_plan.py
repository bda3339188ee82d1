"""Serving plans of catalog models: memfit's, vLLM's block arithmetic and the analytic KV formula side by side.

    python -m bench serve_plan      # prints the table, writes bench/results/serve-plan.json

Every model is built on fake tensors (never real weights); each plan is a handful of ``generate`` traces
(``memfit.generation.serve``), timed here on the machine that runs it. A case that cannot run says why in
the JSON (``skipped``), never with a traceback.
"""

from __future__ import annotations

import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file

from memfit.errors import MemfitError  # noqa: E402
from memfit.generation.serve import serve_plan  # noqa: E402
from memfit.units import format_size  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "serve-plan.json"
# (model, card, context, keywords): the README's row first
CASES = [
    ("llama-3.1-8b", "rtx-4090", 8192, {}),
    ("llama-3.1-8b", "rtx-4090", 8192, {"allow": "int8,nf4"}),
    ("qwen3-8b", "l40s", 32768, {}),
    ("llama-3.2-1b", "l4", 8192, {}),
    ("gemma-3-1b", "l4", 32768, {}),  # 22 of 26 layers keep a 512-token window
    ("llama-3.1-70b", "h100-sxm", 8192, {"gpus": 2, "chunks": [2048]}),  # does not fit one card: device_map
]


def run_case(model, card, context, kw) -> dict:
    start = time.perf_counter()
    try:
        plan = serve_plan(model, gpu=card, context=context, **kw)
    except MemfitError as err:
        return {"model": model, "gpu": card, "context": context, **kw, "skipped": str(err)}
    out = plan.to_dict() | {"seconds": round(time.perf_counter() - start, 1), "settings": kw}
    return out


def line(case: dict) -> str:
    if "skipped" in case:
        return f"{case['model']:<14} {case['gpu']:<9} {case['context']:>6}  skipped: {case['skipped']}"
    fmt = {row["format"]: row for row in case["formats"]}
    if case["chosen"] is None:
        return (f"{case['model']:<14} {case['gpu']:<9} {case['context']:>6}  {case['reason']} | "
                f"{case['seconds']} s")
    rows = " ".join(f"{name} B={row['max_batch']} Lmax={row['max_context']} C={row['chunk']}"
                    for name, row in fmt.items())
    return (f"{case['model']:<14} {case['gpu']:<9} {case['context']:>6}  {rows} | vLLM {case['vllm']['max_concurrency']}"
            f" ({case['vllm']['num_blocks']} blocks) | formula {case['analytic']['max_batch']} | {case['seconds']} s")


def main() -> None:
    cases = []
    for model, card, context, kw in CASES:
        case = run_case(model, card, context, kw)
        cases.append(case)
        print(line(case), flush=True)
    first = cases[0]
    if "skipped" not in first:
        row = first["formats"][0]
        print(f"\n{first['model']} on {first['gpu']} at {first['context']}: weights {format_size(row['weights_bytes'])}, "
              f"KV/request {format_size(row['kv_bytes_per_request'])}, need {format_size(row['need_bytes'])}")
    print(f"wrote {_results.write(RESULTS, cases, machine=platform.platform())}")


if __name__ == "__main__":
    main()
