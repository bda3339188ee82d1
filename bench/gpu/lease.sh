#!/usr/bin/env bash
# One GPU lease's runs at once, as the 2026-11-30 session ran them on an H200 (15 minutes of device time a
# session: every bench in one call). From the repository root on the GPU machine:
#     bash bench/gpu/lease.sh OUT [SITE]      # SITE: a folder of carried packages (DeepSpeed and its needs)
# The card's CPU makes the estimates (CUDA_VISIBLE_DEVICES="") while the GPU runs the truths:
#   gpu_check's DeepSpeed ZeRO-2/3 at world size 1 (issue 51) and three published torchtune rows' steps (issue 53: is
#   their excess over the published peak memfit's?), scripts_gpu (users' scripts) and optimizers (issue 53:
#   each optimizer's first and second step) share the card
#   from the start; edge_fit's budget runs join once its fits are made; its whole-card runs wait for the card
#   to be theirs alone. At most 8 files come back from OUT: the benches write there, and one log.
# SITE (the GPU image has no DeepSpeed): the pure-Python packages copied from a venv with memfit[deepspeed]
# (deepspeed, hjson, pydantic, annotated_types, typing_inspection, typing_extensions.py and their .dist-info;
# torchao for bench optimizers' low-bit cases: bitsandbytes' CUDA build is too large to carry, its case records why) and
# pydantic_core's wheel for the image's Python unzipped beside them (pip download --python-version 3.12
# --only-binary=:all: --platform manylinux2014_x86_64 pydantic-core==VERSION).
set -u
OUT=${1:?usage: lease.sh OUT [SITE]}
SITE=${2:-}
export PYTHONPATH=src${SITE:+:$SITE} PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
log() { sed -u "s/^/[$1] /" >> "$OUT/log.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | log gpu
python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)" 2>&1 | log gpu
python3 -m bench gpu_check --out "$OUT" --cases zero2-llama1b,zero3-llama1b,zero2-offload-llama1b,generate-llama1b-loaded,published-tt-3b-lora,published-tt-8b-lora,published-tt-3b-qlora --workers 4 > >(log zero) 2>&1 &
ZERO=$!
python3 -m bench scripts_gpu > >(log scripts) 2>&1 &
SCRIPTS=$!
python3 -m bench optimizers measure --out "$OUT" > >(log optimizers) 2>&1 &
OPTIMIZERS=$!
python3 -m bench edge_fit estimate --gpu h200 --out "$OUT" --jobs 6 > >(log edge) 2>&1
python3 -m bench edge_fit measure --estimates "$OUT/fit-edge-estimates.json" --out "$OUT" \
    --wait-pids "$ZERO,$SCRIPTS" > >(log edge) 2>&1 &
EDGE=$!
wait "$ZERO" "$SCRIPTS" "$OPTIMIZERS"
cp bench/results/scripts-gpu-*.json "$OUT/" 2>/dev/null
wait "$EDGE"
echo done | log lease
