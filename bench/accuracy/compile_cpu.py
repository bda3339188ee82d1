"""torch.compile'd steps: the estimate against the CPU allocator, beside the eager step.

    python -m bench compile_cpu        # writes bench/results/compile-cpu.json

For each zoo model (``memfit.models.zoo.CASES``, batches large enough that activations matter)
and recipe (``compile=True``: the loss function as one graph; ``compile=layers``: each block and
the loss on their own, as torchtune compiles): the eager step's allocator peak, the compiled
step's allocator peak (the model really compiled by Inductor and run on real tensors, two AdamW
steps, ``memfit.estimator.truth``), the
compiled estimate (fake tensors, Inductor's wrapper run with no-op kernels) and its error, and
the estimate's wall time (compile included). Compile is slow on 2 shared cores: ~10-60 s a row.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

import memfit  # noqa: E402
from memfit import Recipe  # noqa: E402
from memfit.estimator.truth import true_peak  # noqa: E402
from memfit.models.zoo import CASES, gpt_batch, token_batch  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "compile-cpu.json"

# model -> the batch the rows use (the zoo's own, larger where activations would not show)
BATCHES = {
    "mlp": lambda: (torch.randn(2048, 256), torch.randint(0, 10, (2048,))),
    "gpt": lambda: gpt_batch(32, 64),
    "hf-llama": lambda: token_batch(8, 128),
    "hf-gpt2": lambda: token_batch(8, 128),
    "encoder": lambda: (torch.randn(32, 64, 128), torch.randint(0, 10, (32,))),
    "cnn": lambda: (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))),
}
ROWS = [
    ("mlp", {}), ("gpt", {}), ("gpt", {"activation_memory_budget": 0.3}), ("hf-llama", {}),
    ("hf-llama", {"precision": "bf16-mixed"}), ("hf-gpt2", {}), ("encoder", {}), ("cnn", {}),
    # compile with the other techniques (each on top of the plain compiled step)
    ("hf-llama", {"checkpointing": "blocks"}), ("hf-llama", {"grad_accum_steps": 2}),
    ("hf-llama", {"optimizer_in_backward": True}),
    ("hf-llama", {"lora": "lora:8"}), ("hf-llama", {"chunked_loss": 4}),
    # compile="layers": each block and the loss compiled on their own (torchtune's compile_model and
    # compile_loss); the eager column is the same recipe uncompiled
    ("hf-llama", {"compile": "layers"}), ("hf-llama", {"compile": "layers", "checkpointing": "blocks"}),
    ("hf-llama", {"compile": "layers", "precision": "bf16-mixed"}),
    ("hf-llama", {"compile": "layers", "offload_activations": True}),
    ("hf-llama", {"compile": "layers", "checkpointing": "blocks", "offload_activations": True}),
    ("hf-llama", {"compile": "layers", "chunked_loss": 4}), ("hf-llama", {"compile": "layers", "lora": "lora:8"}),
    ("hf-llama", {"compile": "layers", "optimizer_in_backward": True}),
    ("gpt", {"compile": "layers"}), ("gpt", {"compile": "layers", "checkpointing": "blocks"}),
    ("hf-gpt2", {"compile": "layers"}), ("encoder", {"compile": "layers"}),
]


def row(name: str, extra: dict) -> dict:
    factory, _, loss_fn = CASES[name]
    batch = BATCHES[name]()
    eager = Recipe(**{k: v for k, v in extra.items() if k not in ("activation_memory_budget", "compile")})
    loss_fn = None if "chunked_loss" in extra else loss_fn
    compiled = Recipe(**{"compile": True, **extra})
    start = time.perf_counter()
    estimate = memfit.estimate(factory, batch, loss_fn=loss_fn, recipe=compiled).peak_bytes
    seconds = time.perf_counter() - start
    eager_truth = true_peak(factory, batch, loss_fn=loss_fn, recipe=eager)
    truth = true_peak(factory, batch, loss_fn=loss_fn, recipe=compiled)
    torch._dynamo.reset()  # the next row compiles afresh, as a new process would
    return {"model": name, "recipe": compiled.describe(), "batch": [list(t.shape) for t in
                                                                   memfit.techniques.step.batch_tensors(batch)],
            "eager_truth": eager_truth, "compiled_truth": truth, "estimate": estimate,
            "error_bytes": estimate - truth, "error_pct": round(100 * (estimate - truth) / truth, 4),
            "compile_saves_pct": round(100 * (eager_truth - truth) / eager_truth, 2),
            "estimate_seconds": round(seconds, 1)}


def main() -> None:
    rows = []
    for name, extra in ROWS:
        rows.append(row(name, extra))
        print(json.dumps(rows[-1]), flush=True)
    worst = max(abs(r["error_pct"]) for r in rows)
    path = _results.write(RESULTS, rows, {"worst_abs_error_pct": worst}, steps=2, optimizer="adamw")
    print(f"wrote {path}: worst |error| {worst}%")


if __name__ == "__main__":
    main()
