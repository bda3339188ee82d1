"""Write a byte-level token file (nanoGPT's .bin layout, uint16) from the repository's own text,
so the training demo needs no download: `python examples/make_tokens.py out.bin`."""

import pathlib
import sys

import numpy as np

root = pathlib.Path(__file__).resolve().parent.parent
text = b"".join(p.read_bytes() for p in sorted(root.glob("**/*.py")) + sorted(root.glob("**/*.md"))
                if ".venv" not in p.parts and "memfit-run" not in str(p))
np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(sys.argv[1])
print(f"{len(text):,} tokens written to {sys.argv[1]}")
