"""The picture of an estimate in docs/: GPT-2's training step, every block traced.

    python -m bench pictures                      # writes docs/pictures/estimate-gpt2.png
    python -m bench pictures --html /tmp/e.html   # and the interactive page (about 5 MB: not committed)

``memfit.estimate("gpt2", batch_size=4, seq_len=512, fast=False)``: fp32 AdamW on CPU semantics, two
steps (step 1 has no optimizer state yet), drawn by ``memfit.report.pictures.write_png``. The same as
``memfit estimate gpt2 --batch-size 4 --seq-len 512 --full --png docs/pictures/estimate-gpt2.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("MEMFIT_DEVICE", "cpu")  # graded by the CPU allocator: CPU semantics (the default is CUDA)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import memfit  # noqa: E402
from memfit.report.pictures import write_html, write_png  # noqa: E402
from memfit.units import format_size  # noqa: E402

RESULTS = None  # a picture in docs/pictures/, not a table
PNG = os.path.join(ROOT, "docs", "pictures", "estimate-gpt2.png")
TITLE = "memfit estimate gpt2 --batch-size 4 --seq-len 512 --full"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", default=PNG, help="where the PNG goes (default docs/pictures/estimate-gpt2.png)")
    parser.add_argument("--html", default=None, help="also write the interactive page here")
    args = parser.parse_args()
    start = time.perf_counter()
    report = memfit.estimate("gpt2", batch_size=4, seq_len=512, fast=False)
    print(f"estimated in {time.perf_counter() - start:.1f} s: peak {format_size(report.peak_bytes)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    print(f"wrote {write_png(report, args.png, title=TITLE)}")
    if args.html:
        print(f"wrote {write_html(report, args.html, title=TITLE)}")


if __name__ == "__main__":
    main()
