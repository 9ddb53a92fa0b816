#!/usr/bin/env python3
"""Sum an `ncu --csv --metrics gpu__time_duration.sum` report by kernel name (per-kernel time of
one decode step, launched with TINYLOOP_CUDA_GRAPHS=0 so every kernel is profiled)."""
import csv
import sys
from collections import defaultdict

scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, body = rows[0], rows[1:]
name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
grid = head.index("Grid Size") if "Grid Size" in head else None
total, count, grids = defaultdict(float), defaultdict(int), defaultdict(set)
for r in body:
    if len(r) <= value:
        continue
    k = r[name].split("(")[0]
    us = float(r[value].replace(",", "")) * scale.get(r[unit], 1.0)
    total[k] += us
    count[k] += 1
    if grid is not None:
        grids[k].add(r[grid])
all_us = sum(total.values())
print(f"{'kernel':24} {'calls':>5} {'total us':>9} {'avg us':>8}  share  grids")
for k in sorted(total, key=total.get, reverse=True):
    print(f"{k:24} {count[k]:5} {total[k]:9.1f} {total[k] / count[k]:8.2f} {100 * total[k] / all_us:5.1f}%  {' '.join(sorted(grids[k]))[:40]}")
print(f"{'sum':24} {sum(count.values()):5} {all_us:9.1f}")
