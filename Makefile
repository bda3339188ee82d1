# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# torch is installed (CPU build, pinned) only where the environment has none, so a user's own
# CUDA build is kept.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: demo train-demo train-demo-2 test bench docs docs-regenerate setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/memfit plan llama-3.1-8b --gpu rtx-4090 --seq-len 2048 --global-batch-size 64 --allow qlora \
		--out recipe.yaml
	$(BIN)/memfit estimate llama-3.1-8b --seq-len 2048 --gpu rtx-4090 --recipe recipe.yaml

# trains a 4-layer byte-level Llama on the repository's own text, on the CPU, under a 256 MiB virtual budget
train-demo: setup
	mkdir -p memfit-run
	$(BIN)/python examples/make_tokens.py memfit-run/tokens.bin
	$(BIN)/memfit train examples/tiny-llama/config.json --config examples/train-tiny.yaml --no-resume

# the same run on 2 CPU processes under torchrun (gloo): FSDP2 shards the model, rank 0 shows the progress bar
train-demo-2: setup
	mkdir -p memfit-run
	$(BIN)/python examples/make_tokens.py memfit-run/tokens.bin
	$(BIN)/memfit train examples/tiny-llama/config.json --config examples/train-tiny.yaml --no-resume \
		--nproc-per-node 2 --parallel fsdp --out-dir memfit-run/tiny-2

# one pytest worker per core (pytest-xdist): most tests are single-threaded Python tracing; a module's
# tests stay on one worker (loadscope), so its module fixtures (shared traces, sweeps) are made once
# compileall first: where PYTHONDONTWRITEBYTECODE is set (as on these machines) every process the suite starts
# (torchrun ranks, CLI runs) would compile memfit's sources again (~0.4 s CPU each); bytecode written once is read
test: setup
	$(BIN)/python -m compileall -q src bench > /dev/null
	$(BIN)/python -m pytest tests -n auto --dist loadscope --durations=10

# the manual as a site (mkdocs, material theme) in site/; strict: a warning, a broken link or anchor fails it
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# every command output shown in README.md and docs/ rerun and rewritten (--fast-only: the few-second ones;
# --check: rewrite nothing, exit 1 naming each block that differs, as tests/test_docs.py does)
docs-regenerate: setup
	$(BIN)/python docs/regenerate.py

# `make bench NAME=published ARGS="--rows tt-8b-full-4090"` runs one bench (python -m bench NAME ARGS; `python -m
# bench list` names them all); plain `make bench` runs the two quick ones, the README's accuracy and speed tables
bench: setup
ifdef NAME
	$(BIN)/python -m bench $(NAME) $(ARGS)
else
	$(BIN)/python -m bench accuracy
	$(BIN)/python -m bench speed
endif

clean:
	rm -rf $(VENV)
