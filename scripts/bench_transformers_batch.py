#!/usr/bin/env python3
"""Hugging Face transformers' own continuous batching (`generate_batch`) on a
Llama folder: aggregate greedy decode tokens/s with C requests in flight, for
each C given. The reference kiln-server's concurrency sweep is compared with
(scripts/server_concurrency.sh); prints one JSON object per concurrency.

    python3 scripts/bench_transformers_batch.py --model /tmp/kiln-tinyllama-1.1b \
        --concurrency 1 8 32 --max-tokens 64
"""
import argparse
import json
import time

import torch
from transformers import LlamaForCausalLM
from transformers.generation import GenerationConfig


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--attn", default="paged|sdpa",
                        help="the paged attention generate_batch runs on")
    args = parser.parse_args()

    model = LlamaForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation=args.attn
    ).to("cuda").eval()
    vocab = model.config.vocab_size
    # No end-of-sequence token: every request runs max_tokens, as in kiln's sweep.
    config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    for c in args.concurrency:
        n = c * args.requests_per_client
        prompts = [[(r * 7919 + i * 31 + 11) % vocab for i in range(args.prompt_tokens)]
                   for r in range(n)]
        model.generate_batch(inputs=prompts[:c], generation_config=config,
                             progress_bar=False)  # warm-up
        tokens = 0
        start = time.perf_counter()
        # C requests in flight at a time, as the server sweep's C clients.
        for first in range(0, n, c):
            outputs = model.generate_batch(inputs=prompts[first:first + c],
                                           generation_config=config, progress_bar=False)
            tokens += sum(len(o.generated_tokens) for o in outputs.values())
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(json.dumps({"engine": "transformers-generate_batch", "precision": args.dtype,
                          "concurrency": c, "requests": n, "generated_tokens": tokens,
                          "seconds": elapsed, "tokens_per_s": tokens / elapsed}), flush=True)


if __name__ == "__main__":
    main()
