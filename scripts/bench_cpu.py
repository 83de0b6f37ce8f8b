#!/usr/bin/env python3
"""kiln's CPU backends and llama.cpp on one GGUF file, side by side in one run:
the same synthetic prompt (token i is (i * 7919 + 11) % vocab), the same greedy
decode length, the same thread counts. Each round runs every row once, rows
interleaved, so that a change in the machine's load falls on all of them; the
table gives each row's range over the rounds and the 1-minute load average
before and after its runs. Prints a Markdown table.

    python3 -m venv ~/llama-venv   # outside the repository, once
    CMAKE_ARGS="-DGGML_NATIVE=ON" ~/llama-venv/bin/pip install --require-hashes \\
        -r scripts/requirements-llama-cpp.txt   # builds llama.cpp, ~10+ min
    cargo build --release --features xla-iree --bin kiln-bench-decode
    ~/llama-venv/bin/python scripts/bench_cpu.py \\
        --kiln-bench target/release/kiln-bench-decode \\
        --model smollm2-135m-instruct --gguf ~/.cache/kiln/models/smollm2-135m-instruct.gguf \\
        --threads 1 --threads 2 --iree-precision f32 --iree-precision f16

Rows: kiln `cpu` (the f32 reference; one thread whatever the count, so it
runs at the first count only; `--no-reference` leaves it out), kiln `cpu-q4`
(`--threads N`) at each `--activations` (default: q8 and f32; `--no-q4`
leaves them out), kiln `cpu-simd` with `--simd` (the file's own precision:
an F16 or Q8_0 GGUF, which `--convert f16|q8_0` has llama.cpp make from the
pinned file; a row for each `--simd-activations`, which a Q8_0 file's blocks
multiply), kiln `iree-cpu` at each `--iree-precision` (none: no row;
`--threads N`: one runs every kernel on the calling thread, more run them
on N IREE workers; modules compiled before timing by the untimed warm-up),
llama.cpp on the file as
given (`n_threads=N`). kiln-bench-decode needs `--features xla-iree` only for
iree-cpu rows.

`--busy N` runs N busy loops (one process each, `sh -c 'while :; do :; done'`)
beside every row for the whole run, as a laptop or shared server would: the
table's header names them. They are killed when the script exits, on an
error or Ctrl-C too.
"""

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load() -> float:
    return os.getloadavg()[0]


def kiln(args, backend: str, threads: int, precision=None, activations=None) -> dict:
    """One kiln-bench-decode run of one backend; its single JSON result."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "kiln.json"
        command = [
            args.kiln_bench, "--backend", backend, "--model", args.model,
            "--prompt-tokens", str(args.prompt_tokens),
            "--decode-tokens", str(args.decode_tokens),
            "--repeat", str(args.repeat),
            "--max-context", str(args.prompt_tokens + args.decode_tokens + 8),
            "--json", str(out),
        ]
        if backend in ("cpu-q4", "cpu-simd", "iree-cpu"):
            command += ["--threads", str(threads)]
        if backend == "iree-cpu":
            command += ["--precision", precision]
        if activations:
            command += ["--activations", activations]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        (result,) = json.loads(out.read_text())
        return result


def llama_cpp(args, threads: int) -> dict:
    """One scripts/bench_llama_cpp.py run; its single JSON line."""
    out = subprocess.run(
        [sys.executable, str(HERE / "bench_llama_cpp.py"), args.gguf,
         "--threads", str(threads), "--prompt-tokens", str(args.prompt_tokens),
         "--decode-tokens", str(args.decode_tokens), "--repeat", str(args.repeat)],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def rows(args) -> list:
    """(engine, precision, threads, run) for every row of the table."""
    out = []
    counts = args.threads or [1]
    for threads in counts:
        if threads == counts[0] and not args.no_reference:
            out.append(("kiln `cpu`", "f32", 1, lambda: kiln(args, "cpu", 1)))
        for activations in [] if args.no_q4 else args.activations or ["q8", "f32"]:
            out.append(("kiln `cpu-q4`", f"q4 x {activations} activations, q8 output", threads,
                        lambda t=threads, a=activations: kiln(args, "cpu-q4", t, activations=a)))
        if args.simd:
            for activations in args.simd_activations or [None]:
                what = "as the file stores it"
                if activations:
                    what += f", {activations} activations"
                out.append(("kiln `cpu-simd`", what, threads,
                            lambda t=threads, a=activations: kiln(args, "cpu-simd", t,
                                                                  activations=a)))
        for precision in args.iree_precision or []:
            out.append(("kiln `iree-cpu`", precision, threads,
                        lambda t=threads, p=precision: kiln(args, "iree-cpu", t, p)))
        out.append(("llama.cpp", "as the file stores it", threads,
                    lambda t=threads: llama_cpp(args, t)))
    return out


# llama.cpp's file types (`enum llama_ftype`) that --convert writes.
FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}


def convert(src: Path, kind: str, scratch: Path) -> Path:
    """`src` as llama.cpp converts it to `kind` (requantizing a quantized
    file), written into `scratch`; needs the llama-cpp-python venv."""
    import ctypes

    import llama_cpp

    dst = scratch / f"{src.stem}-{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                      ctypes.byref(params)) != 0:
        sys.exit(f"llama.cpp could not convert {src} to {kind}")
    print(f"converted {src} to {kind}: {dst} ({dst.stat().st_size / 1e6:.1f} MB)",
          file=sys.stderr)
    return dst


def start_busy(count: int) -> list:
    """`count` busy-loop processes, each killed at exit (normal, error or
    Ctrl-C: `stop_busy` runs from the caller's `finally` and from atexit)."""
    loops = []
    atexit.register(stop_busy, loops)
    for _ in range(count):
        loops.append(subprocess.Popen(["sh", "-c", "while :; do :; done"],
                                      stdin=subprocess.DEVNULL))
    return loops


def stop_busy(loops: list) -> None:
    """Kills the busy loops still running; safe to call twice."""
    while loops:
        loop = loops.pop()
        if loop.poll() is None:
            loop.kill()
        loop.wait()


def span(values: list) -> str:
    low, high = min(values), max(values)
    return f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kiln-bench", required=True)
    parser.add_argument("--model", required=True, help="what kiln-bench-decode --model takes")
    parser.add_argument("--gguf", required=True, help="the same model's GGUF file, for llama.cpp")
    parser.add_argument("--convert", choices=sorted(FTYPES),
                        help="run both engines on --gguf converted to this type by llama.cpp "
                             "(llama_model_quantize, requantizing), written to a temporary file "
                             "(--model is then ignored)")
    parser.add_argument("--threads", type=int, action="append")
    parser.add_argument("--iree-precision", action="append")
    parser.add_argument("--activations", action="append", choices=["q8", "f32"],
                        help="cpu-q4's (repeat for several; default: both)")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--no-q4", action="store_true",
                        help="no cpu-q4 rows (for a file that is not 4-bit, which cpu-q4 would round)")
    parser.add_argument("--simd", action="store_true",
                        help="cpu-simd rows: every matrix at the file's own precision")
    parser.add_argument("--simd-activations", action="append", choices=["q8", "f32"],
                        help="cpu-simd's activations for a Q8_0 file's blocks, a row each "
                             "(repeat for several; default: kiln's default, f32)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="busy-loop processes beside the runs, for all of them (default: none)")
    args = parser.parse_args()
    if args.busy < 0:
        parser.error("--busy takes a count, 0 or more")

    # SIGTERM ends the script through Python's exit path too, so that the
    # busy loops are killed as on Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory() as scratch:
        if args.convert:
            args.gguf = args.model = str(convert(Path(args.gguf), args.convert, Path(scratch)))
        loops = start_busy(args.busy)
        try:
            run_table(args)
        finally:
            stop_busy(loops)


def run_table(args) -> None:
    """Runs every row `args.rounds` times and prints the table."""
    table = rows(args)
    results = [{"prefill": [], "decode": [], "load": []} for _ in table]
    for round_ in range(args.rounds):
        for (engine, precision, threads, run), result in zip(table, results):
            before = load()
            r = run()
            result["prefill"].append(r["prefill_tokens_per_s"])
            result["decode"].append(r["decode_tokens_per_s"])
            result["load"] += [before, load()]
            print(f"round {round_ + 1}: {engine} {precision}, {threads} thread(s): "
                  f"{r['prefill_tokens_per_s']:.1f} / {r['decode_tokens_per_s']:.1f} tok/s",
                  file=sys.stderr)

    load_note = (f", beside {args.busy} busy loop{'s' if args.busy != 1 else ''} "
                 f"(one process each) on {os.cpu_count()} CPUs" if args.busy else "")
    print(f"prompt {args.prompt_tokens} tokens, {args.decode_tokens} greedy decode steps, "
          f"{args.rounds} rounds (ranges over them){load_note}\n")
    busy = f" ({args.busy} busy loop{'s' if args.busy != 1 else ''} beside)" if args.busy else ""
    print(f"| engine | precision | threads | prefill tok/s | decode tok/s | load avg{busy} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (engine, precision, threads, _), r in zip(table, results):
        print(f"| {engine} | {precision} | {threads} | {span(r['prefill'])} | "
              f"{span(r['decode'])} | {span(r['load'])} |")


if __name__ == "__main__":
    main()
