#!/usr/bin/env python3
"""kiln's CPU backends and llama.cpp on one GGUF file, side by side in one run:
the same synthetic prompt (token i is (i * 7919 + 11) % vocab), the same greedy
decode length, the same thread counts. Prints a Markdown table.

    ~/llama-venv/bin/python scripts/bench_cpu.py \\
        --kiln-bench target/release/kiln-bench-decode \\
        --model smollm2-135m-instruct --gguf ~/.cache/kiln/models/smollm2-135m-instruct.gguf \\
        --threads 1 --threads 2 --prompt-tokens 128 --decode-tokens 64

(the venv as in scripts/llama_cpp_reference.py). kiln's `cpu` backend is
single-threaded at any count; `iree-cpu` is pinned to the first N CPUs with
IREE's `--task_topology_cpu_ids`; llama.cpp gets `n_threads=N`.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def kiln(args, backend: str, threads: int) -> dict:
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
        if backend == "iree-cpu":
            cpus = ",".join(str(i) for i in range(threads))
            command += ["--iree-flags", f"--task_topology_cpu_ids={cpus}"]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kiln-bench", required=True)
    parser.add_argument("--model", required=True, help="what kiln-bench-decode --model takes")
    parser.add_argument("--gguf", required=True, help="the same model's GGUF file, for llama.cpp")
    parser.add_argument("--threads", type=int, action="append")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    rows = []
    for threads in args.threads or [1]:
        for engine, run in [
            ("kiln `cpu` (f32, one thread)", lambda: kiln(args, "cpu", threads)),
            ("kiln `iree-cpu` (f32)", lambda: kiln(args, "iree-cpu", threads)),
            ("llama.cpp (Q4_1 in 4 bits)", lambda: llama_cpp(args, threads)),
        ]:
            r = run()
            rows.append((engine, threads, r["prefill_tokens_per_s"], r["decode_tokens_per_s"]))
            print(f"{engine}, {threads} thread(s): done", file=sys.stderr)

    print(f"prompt {args.prompt_tokens} tokens, {args.decode_tokens} greedy decode steps\n")
    print("| engine | threads | prefill tok/s | decode tok/s |")
    print("| --- | --- | --- | --- |")
    for engine, threads, prefill, decode in rows:
        print(f"| {engine} | {threads} | {prefill:.1f} | {decode:.1f} |")


if __name__ == "__main__":
    main()
