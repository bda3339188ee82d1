# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# torch is installed (CPU build, pinned) only where the environment has none, so a user's own
# CUDA build is kept.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test bench setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/memfit estimate llama-3.1-8b --seq-len 2048 --budget 24GiB
	@echo "\n--- the same model with a recipe that fits a 24 GiB card (LoRA and bf16 weights change the math) ---"
	$(BIN)/memfit estimate llama-3.1-8b --seq-len 2048 --budget 24GiB --precision bf16 --lora lora:16 \
		--checkpointing blocks --chunked-loss 8

test: setup
	$(BIN)/python -m pytest tests

bench: setup
	$(BIN)/python bench/accuracy.py
	$(BIN)/python bench/speed.py

clean:
	rm -rf $(VENV)
