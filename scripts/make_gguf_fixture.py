"""Writes one of kiln's Hugging Face test fixtures (tests/fixtures/NAME) as a
GGUF file with llama.cpp's own writer (the `gguf` package), the way
llama.cpp's converter lays a model of that family out:

- `mistral-gqa-window` as architecture `llama` (llama.cpp writes Mistral so),
  its q and k rows permuted for llama.cpp's RoPE, its window as
  `llama.attention.sliding_window`;
- `qwen2-tied-bias` as architecture `qwen2`, q and k as stored, the q/k/v
  biases as `blk.N.attn_{q,k,v}.bias`, no `output.weight` (tied).

Weights stay f32, so kiln's GGUF model must give the folder's logits, which
tests/hf_reference.rs holds against transformers' (reference.json). The
tokenizer is a byte-level BPE of ASCII characters (see `vocabulary`), enough
for the chat text the server tests send; the family's real one is not public
here.

    python3 -m venv /tmp/gguf && /tmp/gguf/bin/pip install --require-hashes \
        -r scripts/requirements-gguf.txt
    /tmp/gguf/bin/python scripts/make_gguf_fixture.py mistral-gqa-window
    /tmp/gguf/bin/python scripts/make_gguf_fixture.py qwen2-tied-bias
"""

import json
import pathlib
import struct
import sys

import gguf
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests/fixtures"

# Per fixture: the GGUF architecture, whether q/k rows are permuted, the
# tokenizer's pre-tokenizer name, and the chat template the file carries.
FAMILIES = {
    "mistral-gqa-window": {
        "arch": "llama",
        "permute": True,
        "pre": "default",
        "template": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
        "{% endif %}{% endfor %}",
    },
    "qwen2-tied-bias": {
        "arch": "qwen2",
        "permute": False,
        "pre": "qwen2",
        "template": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
        " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}",
    },
}


def read_safetensors(path):
    """The tensors of a safetensors file of f32 tensors, by name."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    body = data[8 + size :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", f"{name} is {info['dtype']}"
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(body[start:end], dtype="<f4").reshape(info["shape"])
    return tensors


def permute(w, heads):
    """llama.cpp's converter's reordering of q/k rows: within each head,
    Hugging Face row j * head_dim/2 + i becomes row 2i + j."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocabulary(n, bos, eos):
    """n tokens in GPT-2's byte-to-character mapping: `<s>` and `</s>` (control
    tokens) at the config's ids, space and newline, printable ASCII from "!",
    and last "!" and '"' merged (a BPE needs a merge), so that chat text in
    ASCII tokenizes."""
    singles = ["\u0120", "\u010a"] + [chr(b) for b in range(ord("!"), ord("~") + 1)]
    tokens = singles[: n - 3] + ["!\""]
    for at, special in sorted([(bos, "<s>"), (eos, "</s>")]):
        tokens.insert(at, special)
    assert len(tokens) == n and len(set(tokens)) == n
    types = [gguf.TokenType.NORMAL] * n
    types[bos] = types[eos] = gguf.TokenType.CONTROL
    return tokens, types


def main(name):
    family = FAMILIES[name]
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    weights = read_safetensors(folder / "model.safetensors")
    arch = family["arch"]
    out = FIXTURES / "gguf" / f"{name}.gguf"
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    window = config.get("sliding_window")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    if window is not None and config.get("use_sliding_window", True):
        writer.add_sliding_window(window)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(family["pre"])
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    tokens, types = vocabulary(config["vocab_size"], bos, eos)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["! \""])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(family["template"])

    names = gguf.TENSOR_NAMES
    t = gguf.MODEL_TENSOR

    def put(kind, tensor, layer=None, suffix="weight"):
        base = names[kind].format(bid=layer) if layer is not None else names[kind]
        writer.add_tensor(f"{base}.{suffix}", np.ascontiguousarray(tensor, dtype=np.float32))

    put(t.TOKEN_EMBD, weights["model.embed_tokens.weight"])
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}"
        q = weights[f"{p}.self_attn.q_proj.weight"]
        k = weights[f"{p}.self_attn.k_proj.weight"]
        if family["permute"]:
            q, k = permute(q, heads), permute(k, kv_heads)
        put(t.ATTN_NORM, weights[f"{p}.input_layernorm.weight"], l)
        put(t.ATTN_Q, q, l)
        put(t.ATTN_K, k, l)
        put(t.ATTN_V, weights[f"{p}.self_attn.v_proj.weight"], l)
        for kind, proj in [(t.ATTN_Q, "q_proj"), (t.ATTN_K, "k_proj"), (t.ATTN_V, "v_proj")]:
            bias = weights.get(f"{p}.self_attn.{proj}.bias")
            if bias is not None:
                put(kind, bias, l, "bias")
        put(t.ATTN_OUT, weights[f"{p}.self_attn.o_proj.weight"], l)
        put(t.FFN_NORM, weights[f"{p}.post_attention_layernorm.weight"], l)
        put(t.FFN_GATE, weights[f"{p}.mlp.gate_proj.weight"], l)
        put(t.FFN_UP, weights[f"{p}.mlp.up_proj.weight"], l)
        put(t.FFN_DOWN, weights[f"{p}.mlp.down_proj.weight"], l)
    put(t.OUTPUT_NORM, weights["model.norm.weight"])
    if not config.get("tie_word_embeddings", False):
        put(t.OUTPUT, weights["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1])
