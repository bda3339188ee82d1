#!/bin/bash
# Runs probe.py (real, 2 ranks) for each case given (default: all), timing each; results in /tmp/ds51/out.
cd /tmp/ds51
mkdir -p out logs
cases="${@:-z1 z1-small z1-bf16opt z2 z2-small z2-overlap z2-nocontig z2-fp32 z2-accum z2-offload z3 z3-small z3-offload}"
for c in $cases; do
  start=$(date +%s.%N)
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 timeout 600 venv/bin/python -m torch.distributed.run --standalone \
    --nproc_per_node 2 probe.py --case $c --out out > logs/$c.log 2>&1
  rc=$?
  end=$(date +%s.%N)
  printf "%-12s rc=%s wall=%.1fs\n" $c $rc $(echo "$end - $start" | bc)
done
