#!/usr/bin/env python3
"""llama.cpp's answers on a GGUF model, as a small fixture for kiln's tests
(tests/gguf_smollm2.rs): token ids, the top of the last-position logits and
32 greedy tokens for a few prompts (ASCII, accented Latin, CJK, emoji, chat).

llama.cpp runs the file as given (block-quantized matrix products) and, as
the exact-dequantization reference kiln is compared with, a copy rewritten
as F32 by llama_model_quantize (ftype 0, ALL_F32) with an F32 KV cache.

    python3 -m venv ~/llama-venv   # outside the repository
    CMAKE_ARGS=-DGGML_NATIVE=OFF ~/llama-venv/bin/pip install --require-hashes \\
        -r scripts/requirements-llama-cpp.txt   # builds llama.cpp, ~10+ min
    ~/llama-venv/bin/python scripts/llama_cpp_reference.py MODEL.gguf \\
        tests/fixtures/gguf/smollm2.llama_cpp.json

The checked-in fixture was made this way on a 16-core x86-64 machine with
Python 3.12 (llama.cpp built with -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF). There,
a Python whose environment carried an older libstdc++ crashed in llama.cpp's
tokenizer set-up; LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 fixed it.
"""

import ctypes
import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import llama_cpp
from llama_cpp import Llama

PROMPTS = [
    "The capital of France is",
    "Le café était très amer, mais la crème brûlée était délicieuse.",
    "東京は日本の首都で、人口は約千四百万人です。",
    "I love pizza 🍕 and tacos 🌮! 👩‍🚀",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
TOP_K = 20
GREEDY = 32
THREADS = 2
GGML_TYPE_F32 = 0


def to_f32(src: Path, dst: Path) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 0  # LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = THREADS
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        sys.exit("llama_model_quantize failed")


def open_model(path: Path) -> Llama:
    return Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=THREADS,
                 n_threads_batch=THREADS, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
                 flash_attn=False, verbose=False)


def last_logits(llm: Llama, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return logits_now(llm)


def greedy(llm: Llama, ids: list[int]) -> list[int]:
    logits = last_logits(llm, ids)
    out = []
    for _ in range(GREEDY):
        token = int(np.argmax(logits))
        out.append(token)
        llm.eval([token])
        logits = logits_now(llm)
    return out


def logits_now(llm: Llama) -> np.ndarray:
    """The logits of the last position evaluated, as llama.cpp holds them."""
    pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        f32_path = Path(tmp) / "model-f32.gguf"
        to_f32(model, f32_path)
        exact, quantized = open_model(f32_path), open_model(model)
        cases = []
        for text in PROMPTS:
            ids = exact.tokenize(text.encode(), add_bos=False, special=True)
            assert ids == quantized.tokenize(text.encode(), add_bos=False, special=True)
            f32 = last_logits(exact, ids)
            q = last_logits(quantized, ids)
            top = np.argsort(-f32, kind="stable")[:TOP_K]
            cases.append({
                "text": text,
                "ids": ids,
                "top_ids": top.tolist(),
                "top_logits_f32": [float(f32[i]) for i in top],
                "top_logits_quantized": [float(q[i]) for i in top],
                "greedy_f32": greedy(exact, ids),
                "greedy_quantized": greedy(quantized, ids),
            })
    fixture = {"source": model.name, "llama_cpp_python": version("llama_cpp_python"),
               "threads": THREADS, "kv_cache": "f32", "cases": cases}
    out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
