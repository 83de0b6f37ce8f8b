#!/usr/bin/env python3
"""Makes kiln's Hugging Face reference fixtures: random-weight Llama,
Mistral and Qwen2 models (grouped-query attention, odd sizes, tied and
untied embeddings, two RoPE scalings, a sliding window, q/k/v biases) saved
as safetensors, with
the logits `transformers` computes for a few prompts and its greedy
continuation. kiln's CPU reference must match them.

    python3 scripts/make_fixture.py tests/fixtures [NAME ...]

makes every fixture, or only those named.

Needs torch and transformers (any recent version; the committed fixtures were
made with the versions printed into each fixture's reference.json).
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM)}

MODELS = {
    # Untied, GQA 6:2, odd intermediate and vocabulary, llama3 RoPE scaling.
    "llama-gqa-untied": dict(
        hidden_size=60, intermediate_size=97, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=10,
        vocab_size=103, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    # Tied, multi-query (4:1), three layers, linear RoPE scaling.
    "llama-mqa-tied": dict(
        hidden_size=40, intermediate_size=75, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=10,
        vocab_size=89, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # Mistral's own config (model_type "mistral"), GQA 4:2, θ 1e6 as Mistral
    # 7B v0.2/v0.3, and v0.1's sliding window, wider than every sequence
    # here (kiln caps its context at the window, where attention is full).
    "mistral-gqa-window": dict(
        family="mistral",
        hidden_size=48, intermediate_size=83, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        vocab_size=97, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=64, sliding_window=40, bos_token_id=1,
        eos_token_id=2, rope_theta=1000000.0,
    ),
    # Qwen2.5's small sizes: biases on q/k/v, tied embeddings, θ 1e6, and a
    # sliding window that `use_sliding_window: false` switches off. Sizes
    # in whole blocks of 32, so cpu-q4 can take it too.
    "qwen2-tied-bias": dict(
        family="qwen2",
        hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=97, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=64, use_sliding_window=False, sliding_window=32,
        max_window_layers=1, bos_token_id=1, eos_token_id=2, rope_theta=1000000.0,
    ),
}

PROMPTS = [[1, 5, 9], [1, 17, 3, 42, 8, 8, 0, 33, 71, 12, 5, 60, 2, 19]]
GREEDY_STEPS = 16


def word_level_tokenizer(vocab_size):
    """A minimal tokenizer.json: token i is the word `t{i}`."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab_size)},
                  "unk_token": "t0"},
    }


def main(out_dir, names):
    for name in names:
        kwargs = dict(MODELS[name])
        config_class, model_class = FAMILIES[kwargs.pop("family", "llama")]
        # Seeded per model, so one fixture can be made again on its own.
        torch.manual_seed(sorted(MODELS).index(name))
        config = config_class(**kwargs, attn_implementation="eager")
        model = model_class(config).to(torch.float32).eval()
        # Norm weights away from 1.0, so a missed norm weight shows, and
        # biases (initialized to zero) large enough that a missed one does.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
                elif n.endswith(".bias"):
                    p.uniform_(-0.5, 0.5)
        folder = Path(out_dir) / name
        model.save_pretrained(folder, safe_serialization=True)
        (folder / "tokenizer.json").write_text(json.dumps(word_level_tokenizer(config.vocab_size)))
        reference = {"torch": torch.__version__, "transformers": transformers.__version__,
                     "prompts": [], "logits": [], "greedy": []}
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = torch.tensor([prompt])
                logits = model(ids).logits[0].to(torch.float32)
                reference["prompts"].append(prompt)
                reference["logits"].append(logits.tolist())
                tokens = list(prompt)
                for _ in range(GREEDY_STEPS):
                    nxt = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
                    tokens.append(nxt)
                reference["greedy"].append(tokens[len(prompt):])
        (folder / "reference.json").write_text(json.dumps(reference))
        print(name, "config:", (folder / "config.json").read_text())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures", sys.argv[2:] or list(MODELS))
