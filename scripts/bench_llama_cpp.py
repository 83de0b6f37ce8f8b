#!/usr/bin/env python3
"""llama.cpp's side of kiln's CPU comparison: prefill and greedy-decode tokens/s
on a GGUF file, with the same synthetic prompt as kiln-bench-decode (token i is
(i * 7919 + 11) % vocab) and the same thread count.

    ~/llama-venv/bin/python scripts/bench_llama_cpp.py MODEL.gguf \\
        --threads 2 --prompt-tokens 128 --decode-tokens 64

(the venv as in scripts/llama_cpp_reference.py). Prints one JSON line per
prompt length. Times are of llama-cpp-python's `eval`, which also copies the
logits into a numpy array each call.
"""

import argparse
import json
import time

import numpy as np
import llama_cpp
from llama_cpp import Llama


def logits_now(llm: Llama) -> np.ndarray:
    """The logits of the last position evaluated, as llama.cpp holds them."""
    pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, action="append")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    prompts = args.prompt_tokens or [64]
    context = max(prompts) + args.decode_tokens + 8
    llm = Llama(model_path=args.model, n_ctx=context, n_batch=context, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    vocab = llm.n_vocab()
    for n in prompts:
        prompt = [(i * 7919 + 11) % vocab for i in range(n)]
        llm.reset()
        llm.eval(prompt)  # warm-up
        started = time.perf_counter()
        for _ in range(args.repeat):
            llm.reset()
            llm.eval(prompt)
        prefill_s = (time.perf_counter() - started) / args.repeat
        token = int(np.argmax(logits_now(llm)))
        started = time.perf_counter()
        for _ in range(args.decode_tokens):
            llm.eval([token])
            token = int(np.argmax(logits_now(llm)))
        decode_s = time.perf_counter() - started
        print(json.dumps({
            "engine": "llama.cpp", "model": args.model, "threads": args.threads,
            "prompt_tokens": n, "prefill_tokens_per_s": n / prefill_s,
            "decode_tokens": args.decode_tokens,
            "decode_tokens_per_s": args.decode_tokens / decode_s,
        }))


if __name__ == "__main__":
    main()
