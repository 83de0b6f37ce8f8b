#!/usr/bin/env python3
"""Hugging Face transformers on a Llama folder (the weights kiln runs, as
written by `kiln-bench-decode --write-model`): prefill tokens/s at the given
prompt lengths and greedy decode tokens/s with the KV cache, batch 1, eager
attention. The reference kiln-bench-decode is compared with; prints one JSON
object per measurement.

    python3 scripts/bench_transformers.py --model /tmp/tinyllama --dtype float16 --prompt 128 512

With --random-weights the folder needs only its config.json: the weights are
drawn on the GPU (for speed alone, where writing a model's safetensors would
take longer than the measurement, e.g. Llama-3.1-8B's shape).
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def load(model_dir, dtype, random_weights=False):
    if random_weights:
        config = LlamaConfig.from_pretrained(model_dir, attn_implementation="eager")
        torch.set_default_dtype(getattr(torch, dtype))
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
        torch.set_default_dtype(torch.float32)
        return model.eval()
    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    return model.to("cuda").eval()


def prompt_ids(n, vocab):
    """The prompt kiln-bench-decode feeds: token i is (7919 i + 11) mod vocab."""
    return torch.tensor([[(i * 7919 + 11) % vocab for i in range(n)]], device="cuda")


@torch.no_grad()
def measure(model, dtype, prompts, decode, repeat):
    rows = []
    for n in prompts:
        ids = prompt_ids(n, model.config.vocab_size)
        model(ids)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            model(ids)
        torch.cuda.synchronize()
        prefill = n * repeat / (time.perf_counter() - start)
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(decode):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        rows.append({
            "engine": "transformers-eager", "precision": dtype, "prompt_tokens": n,
            "prefill_tokens_per_s": prefill,
            "decode_tokens": decode,
            "decode_tokens_per_s": decode / (time.perf_counter() - start),
        })
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a Llama folder (config.json, safetensors)")
    parser.add_argument("--dtype", nargs="+", default=["float16"],
                        choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--prompt", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--random-weights", action="store_true",
                        help="draw the weights on the GPU; the folder needs only config.json")
    args = parser.parse_args()
    for dtype in args.dtype:
        model = load(args.model, dtype, args.random_weights)
        for row in measure(model, dtype, args.prompt, args.decode, args.repeat):
            print(json.dumps(row))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
