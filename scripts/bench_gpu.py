#!/usr/bin/env python3
"""kiln against Hugging Face transformers on one GPU, side by side in one
call, on the same weights: a random Llama of a kiln preset's shape
(TinyLlama-1.1B's by default, `--preset llama-3.1-8b` for Llama-3.1-8B's)
written by kiln-bench-decode as f16 safetensors.

1. Measures the GPU's copy bandwidth (device-to-device, bytes read plus
   written), the ceiling decode is held against.
2. Writes the model folder (once).
3. Runs transformers (eager) at each --hf-dtype, then kiln-bench-decode with
   --backend iree-cuda at each --precision, on that folder.
4. Prints one table: prefill and decode tokens/s, decode's share of the
   bandwidth bound (weight bytes per step over the copy bandwidth), and
   kiln's ratio to transformers at the same precision.

With --random-weights each engine draws its own random weights of that
shape instead (kiln from the preset, transformers on the GPU from the
preset's config.json alone): for shapes whose folder takes longer to write
and read than to measure, such as Llama-3.1-8B's 16 GB.

Modules must be in KILN_CACHE_DIR already (`kiln-bench-decode --prepare`
where the compiler is). Example, on the GPU machine:

    python3 scripts/bench_gpu.py --kiln-bench ./kiln-bench-decode --precision f32 f16
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_transformers  # noqa: E402

HF_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def copy_bandwidth(gib=2, runs=20):
    """Median device-to-device copy rate, bytes read plus written per second."""
    n = gib * 2**30 // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    if not torch.equal(dst, src):
        raise SystemExit("copy check failed")
    return 2 * n * 4 / times[len(times) // 2]


def run_kiln(args, model_dir):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [args.kiln_bench, "--backend", "iree-cuda", "--model", model_dir,
               "--max-context", str(args.max_context), "--decode-tokens", str(args.decode),
               "--repeat", str(args.repeat), "--json", out.name]
        for p in args.precision:
            cmd += ["--precision", p]
        for layout in args.weight_layout:
            cmd += ["--weight-layout", layout]
        for rows in args.q4_rows:
            cmd += ["--q4-rows", rows]
        for flags in args.iree_flags:
            cmd.append(f"--iree-flags={flags}")
        for n in args.prompt:
            cmd += ["--prompt-tokens", str(n)]
        for n in args.steps_per_call:
            cmd += ["--steps-per-call", str(n)]
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            print("kiln-bench-decode failed; its rows are missing", flush=True)
            return []
        return json.load(open(out.name))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kiln-bench", required=True, help="path of kiln-bench-decode")
    parser.add_argument("--preset", default="tinyllama-1.1b",
                        help="the kiln-bench-decode preset whose shape is measured")
    parser.add_argument("--model-dir", help="where that model is written (default /tmp/kiln-PRESET)")
    parser.add_argument("--precision", nargs="+", default=["f32", "f16"])
    parser.add_argument("--weight-layout", nargs="*", default=[])
    parser.add_argument("--q4-rows", nargs="*", default=[],
                        help="q4's row products to measure, each a row (configured, kernel)")
    parser.add_argument("--iree-flags", action="append", default=[],
                        help="a set of IREE runtime flags to measure kiln with (repeat)")
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[1],
                        help="kiln's greedy steps per device call, each a row")
    parser.add_argument("--hf-dtype", nargs="+", default=["float32", "float16"])
    parser.add_argument("--prompt", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-context", type=int, default=640)
    parser.add_argument("--json", help="also write every row here")
    parser.add_argument("--random-weights", action="store_true",
                        help="each engine draws its own weights of the preset's shape "
                             "(no f16 folder is written)")
    args = parser.parse_args()
    args.model_dir = args.model_dir or f"/tmp/kiln-{args.preset}"

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        write = "--write-config" if args.random_weights else "--write-model"
        subprocess.run([args.kiln_bench, "--model", args.preset, write, args.model_dir],
                       check=True)

    rows = []
    for dtype in args.hf_dtype:
        model = bench_transformers.load(args.model_dir, dtype, args.random_weights)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = model.model.embed_tokens.weight
        step_bytes = weight_bytes - embed.numel() * embed.element_size()
        for row in bench_transformers.measure(model, dtype, args.prompt, args.decode, args.repeat):
            row["layout"] = "-"
            row["decode_weight_bytes"] = step_bytes
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    for row in run_kiln(args, args.preset if args.random_weights else args.model_dir):
        row["engine"] = "kiln-" + row["backend"]
        row["precision"] = HF_DTYPE.get(row["precision"], row["precision"])
        rows.append(row)

    reference = {(r["precision"], r["prompt_tokens"]): r for r in rows
                 if r["engine"].startswith("transformers")}
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; decode bound = weight bytes per step / that")
    header = ("engine", "precision", "layout", "IREE flags", "steps/call", "prompt", "prefill tok/s",
              "decode tok/s", "% of bound", "x hf prefill", "x hf decode")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        bound = bandwidth / r["decode_weight_bytes"]
        ref = reference.get((r["precision"], r["prompt_tokens"]))
        ratio = (lambda k: f"{r[k] / ref[k]:.2f}") if ref else (lambda k: "-")
        r["percent_of_bandwidth_bound"] = 100 * r["decode_tokens_per_s"] / bound
        print(f"| {r['engine']} | {r['precision']} | {r['layout']} | {r.get('iree_flags') or '-'} | "
              f"{r.get('steps_per_call', '-')} | {r['prompt_tokens']} | "
              f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.1f} | "
              f"{r['percent_of_bandwidth_bound']:.1f} | {ratio('prefill_tokens_per_s')} | "
              f"{ratio('decode_tokens_per_s')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
