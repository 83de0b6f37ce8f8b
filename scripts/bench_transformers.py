#!/usr/bin/env python3
"""Hugging Face transformers on a random-weight Llama of TinyLlama-1.1B's
shape: prefill tokens/s at the given prompt lengths and greedy decode tokens/s
with the KV cache, batch 1, eager attention — the reference kiln-bench-decode
is compared with. Prints one JSON object per measurement.

    python3 scripts/bench_transformers.py --dtype float32 --prompt 128 512 --decode 64
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--prompt", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                         max_position_embeddings=2048, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()
    with torch.no_grad():
        for n in args.prompt:
            ids = torch.randint(0, config.vocab_size, (1, n), device="cuda")
            model(ids)  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.repeat):
                model(ids)
            torch.cuda.synchronize()
            prefill = n * args.repeat / (time.perf_counter() - start)
            out = model(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.decode):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            decode = args.decode / (time.perf_counter() - start)
            print(json.dumps({"engine": "transformers", "dtype": args.dtype, "prompt_tokens": n,
                              "prefill_tokens_per_s": round(prefill, 1),
                              "decode_tokens": args.decode, "decode_tokens_per_s": round(decode, 1)}))


if __name__ == "__main__":
    main()
