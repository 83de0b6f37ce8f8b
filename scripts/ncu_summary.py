#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV (`ncu --csv --print-units base --metrics
gpu__time_duration.sum`) of kiln decode steps: kernel time per step by kind
of dispatch (IREE names dispatches `<function>_dispatch_<n>_<kind>_<shape>`),
with the bytes each matrix-vector kernel must read and the rate that gives.

    python3 scripts/ncu_summary.py ncu.csv --steps 2 --weight-bytes 2
"""
import argparse
import collections
import csv
import re


def kind_of(name):
    m = re.search(r"_dispatch_\d+_([a-z_]+?)(?:_\d|$)", name)
    return m.group(1) if m else name


def matvec_bytes(name, weight_bytes):
    """Weight bytes a matvec/vecmat kernel reads: its two sizes' product."""
    m = re.search(r"_(?:matvec|vecmat)_(\d+)x(\d+)_", name)
    return int(m.group(1)) * int(m.group(2)) * weight_bytes if m else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--steps", type=int, default=1, help="decode steps the profile covers")
    p.add_argument("--weight-bytes", type=int, default=2, help="bytes per weight")
    args = p.parse_args()
    rows = [r for r in csv.DictReader(l for l in open(args.csv) if l.startswith('"'))
            if r.get("Metric Name") == "gpu__time_duration.sum"]
    per_kind = collections.defaultdict(lambda: [0, 0.0, 0])
    for r in rows:
        name = r["Kernel Name"]
        ns = float(r["Metric Value"].replace(",", ""))
        k = per_kind[kind_of(name)]
        k[0] += 1
        k[1] += ns
        k[2] += matvec_bytes(name, args.weight_bytes)
    total = sum(v[1] for v in per_kind.values())
    print(f"{len(rows) / args.steps:.0f} kernels per step, {total / args.steps / 1e3:.1f} us of kernel time per step")
    print("| dispatch kind | kernels/step | us/step | share | GB/s (weights) |")
    print("|---|---|---|---|---|")
    for kind, (count, ns, nbytes) in sorted(per_kind.items(), key=lambda kv: -kv[1][1]):
        rate = f"{nbytes / ns:.0f}" if nbytes else "-"
        print(f"| {kind} | {count / args.steps:.0f} | {ns / args.steps / 1e3:.1f} | "
              f"{100 * ns / total:.1f}% | {rate} |")


if __name__ == "__main__":
    main()
