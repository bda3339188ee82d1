#!/bin/bash
# probe_fake.py for each case (default: all) and both ranks; results in /tmp/ds51/fakeout
cd /tmp/ds51
mkdir -p fakeout logs
cases="${@:-z1 z1-small z1-bf16opt z2 z2-small z2-overlap z2-nocontig z2-fp32 z2-accum z2-offload z3 z3-small z3-offload}"
for c in $cases; do for r in 0 1; do
  /usr/bin/time -f "$c rank$r user=%Us sys=%Ss wall=%es" -a -o fake_times.txt \
    env DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=/work/main/src timeout 900 \
    venv/bin/python probe_fake.py --case $c --rank $r --out fakeout > logs/fake-$c-$r.log 2>&1
done; done
echo ALLDONE >> fake_times.txt
