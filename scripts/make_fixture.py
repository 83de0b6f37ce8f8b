#!/usr/bin/env python3
"""Makes kiln's Hugging Face reference fixtures: random-weight Llama,
Mistral and Qwen2 models (grouped-query attention, odd sizes, tied and
untied embeddings, two RoPE scalings, a sliding window, q/k/v biases) saved
as safetensors, with
the logits `transformers` computes for a few prompts and its greedy
continuation. kiln's CPU reference must match them.

    python3 scripts/make_fixture.py tests/fixtures [NAME ...]

makes every committed fixture, or only those named. The wide ones (WIDE:
each family's real widths and vocabulary, one or two layers, 0.7-2 GB) are
made only when named, on the machine that runs them, and are not
committed; `--config-only` writes just their config.json (for preparing
IREE modules where the compiler is; transformers without torch does it).

Needs torch and transformers (any recent version; the committed fixtures were
made with the versions printed into each fixture's reference.json).
"""
import json
import sys
from pathlib import Path

import transformers
from transformers import LlamaConfig, MistralConfig, Qwen2Config

CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}

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

# Each family's real widths (Qwen2.5-0.5B, Llama-3.2-1B, Mistral-7B-v0.3)
# with one or two layers: the shapes kernels see, for the oracle at width.
WIDE = {
    "qwen2.5-0.5b-wide": dict(
        family="qwen2",
        hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=32768, use_sliding_window=False, sliding_window=32768,
        max_window_layers=2, bos_token_id=151643, eos_token_id=151645, rope_theta=1000000.0,
    ),
    "llama-3.2-1b-wide": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "mistral-7b-wide": dict(
        family="mistral",
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=32768, sliding_window=None, bos_token_id=1,
        eos_token_id=2, rope_theta=1000000.0,
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


def config_of(name):
    kwargs = dict({**MODELS, **WIDE}[name])
    family = kwargs.pop("family", "llama")
    return family, CONFIGS[family](**kwargs, attn_implementation="eager")


def main(out_dir, names, config_only):
    if config_only:
        for name in names:
            config_of(name)[1].save_pretrained(Path(out_dir) / name)
        return
    import torch
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
    models = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}
    for name in names:
        family, config = config_of(name)
        # Seeded per model, so one fixture can be made again on its own.
        seed = sorted(MODELS).index(name) if name in MODELS else 100 + sorted(WIDE).index(name)
        torch.manual_seed(seed)
        model = models[family](config).to(torch.float32).eval()
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
    args = [a for a in sys.argv[1:] if a != "--config-only"]
    main(args[0] if args else "tests/fixtures", args[1:] or list(MODELS),
         "--config-only" in sys.argv)
