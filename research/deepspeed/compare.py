"""Real (probe.py) vs fake (probe_fake.py) per case and rank."""
import json, glob, os
rows = []
for f in sorted(glob.glob('/tmp/ds51/out/*-rank*.json')):
    r = json.load(open(f))
    fk = f'/tmp/ds51/fakeout/fake-{r["case"]}-rank{r["rank"]}.json'
    k = json.load(open(fk)) if os.path.exists(fk) else {}
    err = (k.get("error") or "").strip().splitlines()[-1:] if k.get("error") else []
    fp = k.get("peak_bytes")
    diff = (fp - r["peak_bytes"]) if fp else None
    rows.append((r["case"], r["rank"], r["optimizer"], r["peak_bytes"], fp, diff,
                 (100.0 * diff / r["peak_bytes"]) if diff is not None else None, r["live_at_start"],
                 k.get("live_at_start"), r["run_s"], k.get("run_s"), err))
print(f"{'case':12} {'rk':2} {'optimizer':30} {'truth peak':>14} {'fake peak':>14} {'diff B':>9} {'diff %':>8} {'truth start':>13} {'fake start':>13} {'t_real':>6} {'t_fake':>6}")
for c, rk, o, tp, fp, d, pct, ts, fs, tr, tf, err in rows:
    print(f"{c:12} {rk:2} {o:30} {tp:>14,} {fp if fp is None else format(fp, ','):>14} {d if d is None else format(d, ','):>9} "
          f"{'' if pct is None else format(pct, '.4f'):>8} {ts:>13,} {fs if fs is None else format(fs, ','):>13} {tr:>6} {tf if tf else '':>6} {err}")
