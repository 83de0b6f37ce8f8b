#!/usr/bin/env python3
"""Writes an `iree-benchmark-module` flag file for a function of a kiln module
exported by `kiln-bench-decode --prepare --export DIR`: one splat `--input`
per argument, read off the function's signature in the `.mlir`, so that IREE's
own benchmark tool can time the module without kiln around it.

    python3 scripts/iree_benchmark_flags.py DIR/model-cuda-f16-out-in-decode.mlir \
        --function decode_step --device cuda > decode.flags
    iree-benchmark-module --flagfile=decode.flags --module=DIR/...-decode.vmfb

Integer arguments get `--int` (token ids and positions), float ones
`--float` (not zero: zero data can run faster than real data). IREE cannot
splat sub-byte types (q4's `xi4` weights), so those are read from a file of
raw bytes, `--sub-byte-dir` (default /tmp) holding one per argument; the
command that writes it (random bytes, the argument's size) goes to stderr.
(On 2026-12-07 the 8B's q4 prefill ran out of its time limit reading one of
3.75 GB, so IREE's tools have yet to be seen taking such a file.)
"""
import argparse
import os
import re
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mlir")
    p.add_argument("--function", default="decode_step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--int", default="7")
    p.add_argument("--float", default="0.01")
    p.add_argument("--sub-byte-dir", default="/tmp")
    args = p.parse_args()
    text = open(args.mlir).read()
    m = re.search(r"func\.func @" + re.escape(args.function) + r"\((.*?)\)\s*->", text, re.S)
    if not m:
        raise SystemExit(f"no function {args.function} in {args.mlir}")
    print(f"--device={args.device}")
    print(f"--function={args.function}")
    for n, ty in enumerate(re.findall(r"tensor<([^>]*)>", m.group(1))):
        *dims, element = ty.split("x")
        bits = int(element[1:]) if element[0] in "iuf" and element[1:].isdigit() else 8
        if bits < 8:
            count = 1
            for d in dims:
                count *= int(d)
            size = count * bits // 8
            path = os.path.join(args.sub_byte_dir, f"iree-input{n}-{size}.bin")
            print(f"head -c {size} /dev/urandom > {path}", file=sys.stderr)
            value = "@" + path
        else:
            value = args.int if element.startswith("i") else args.float
        print(f"--input={'x'.join(dims + [element])}={value}")


if __name__ == "__main__":
    main()
