"""Summarises an Nsight Compute CSV (`--csv --page raw --metrics gpu__time_duration.sum`):
the kernel count, their summed GPU time, and the kernels that took the most of it."""
import csv
import sys
from collections import defaultdict

rows = list(csv.reader(line for line in open(sys.argv[1]) if not line.startswith("==")))
head = rows[0]
name, time = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
unit = rows[1][time]
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[unit]
total, per = 0.0, defaultdict(lambda: [0, 0.0])
for r in rows[2:]:
    t = float(r[time].replace(",", "")) * scale
    total += t
    short = r[name].split("(")[0].split("<")[0][:60]
    per[short][0] += 1
    per[short][1] += t
n = sum(c for c, _ in per.values())
print(f"{n} kernels, {total:.0f} us of GPU time")
for k, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:12]:
    print(f"  {t:8.1f} us {c:4d}x {k}")
