#!/usr/bin/env python3
"""Writes a GGUF file of Llama-3.1-8B's shape with random Q4_0 (or, with
`--type q8_0`, Q8_0) weights, for comparing kiln with llama.cpp
(scripts/gpu_all.sh, part `llamacpp`) on the very same file.

    python3 scripts/write_llama_gguf.py /tmp/llama-8b-q4_0.gguf
    python3 scripts/write_llama_gguf.py --type q8_0 /tmp/llama-8b-q8_0.gguf

Needs numpy alone: the GGUF (version 3) is written by hand. Tensor types are
those `llama-quantize ... Q4_0` gives a Llama: every matrix Q4_0, the token
embedding too, but `output.weight` Q6_K (`--output-type q4_0` makes it Q4_0),
norms F32 (all ones). As `llama-quantize ... Q8_0` gives: every matrix Q8_0,
`output.weight` too. Scales are random around 1/sqrt(columns) over the
levels' spread (4.6 for Q4_0's, 73 for Q8_0's), so a product of a unit vector
stays near unit size; quants are random bytes.
Unlike Meta's Llama-3.1-8B files it has no `rope_freqs.weight` (Llama 3.1's
RoPE frequency factors), which kiln does not read yet: the RoPE is Llama 3's.

The tokenizer is a byte-level BPE one (`tokenizer.ggml.model` gpt2, `pre`
llama-bpe, as Llama 3's): the 256 byte symbols, 65,536 two-symbol tokens and
62,208 three-symbol ones with the merges that make them, then Llama 3's 256
special tokens (`<|begin_of_text|>` 128000 is BOS, `<|eot_id|>` 128009 EOS),
128,256 in all. llama.cpp and kiln (crates/kiln-core/src/gguf/tokenizer.rs)
both build a working tokenizer from it. `--check` reads the header back.
About 4.6 GB at Q4_0, 8.5 GB at Q8_0; seconds of numpy plus the disk.
"""

import argparse
import os
import struct
import sys
import time

import numpy as np

GGUF_MAGIC = b"GGUF"
ALIGNMENT = 32

# GGUF metadata value types.
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64 = 4, 5, 6, 7, 8, 9, 10
# ggml tensor types, and their (elements, bytes) per block.
F32, Q4_0, Q8_0, Q6_K = 0, 2, 8, 14
BLOCK = {F32: (1, 4), Q4_0: (32, 18), Q8_0: (32, 34), Q6_K: (256, 210)}
# llama.cpp's token types.
NORMAL, CONTROL = 1, 3
# general.file_type of each: LLAMA_FTYPE_MOSTLY_Q4_0, _Q8_0.
FILE_TYPE = {Q4_0: 2, Q8_0: 7}
TYPES = {"q4_0": Q4_0, "q8_0": Q8_0}


def gstr(s):
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value):
    out = gstr(key) + struct.pack("<I", vtype)
    if vtype == T_STRING:
        return out + gstr(value)
    fmt = {T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q"}[vtype]
    return out + struct.pack(fmt, value)


def kv_array(key, etype, values):
    head = gstr(key) + struct.pack("<IIQ", T_ARRAY, etype, len(values))
    if etype == T_STRING:
        return head + b"".join(gstr(v) for v in values)
    dtype = {T_INT32: "<i4", T_FLOAT32: "<f4", T_UINT32: "<u4"}[etype]
    return head + np.asarray(values, dtype=dtype).tobytes()


def byte_symbols():
    """GPT-2's byte-level alphabet: byte b's symbol, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    symbols, extra = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def vocabulary(n_vocab):
    """Tokens, token types and merges (see the module's doc)."""
    n_special = 256
    n_normal = n_vocab - n_special
    if n_normal < 256:
        raise SystemExit(f"vocab {n_vocab} is too small: 256 byte symbols and 256 special tokens")
    sym = byte_symbols()
    tokens, merges = list(sym), []
    pairs = [(a, b) for a in sym for b in sym]
    for a, b in pairs[: n_normal - len(tokens)]:
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    for a, b in pairs:
        for c in sym:
            if len(tokens) == n_normal:
                break
            tokens.append(a + b + c)
            merges.append(f"{a + b} {c}")
        if len(tokens) == n_normal:
            break
    if len(tokens) != n_normal:
        raise SystemExit(f"vocab {n_vocab} is larger than this tokenizer makes")
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 2: "<|reserved_special_token_0|>",
             3: "<|reserved_special_token_1|>", 4: "<|finetune_right_pad_id|>",
             5: "<|reserved_special_token_2|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
             8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>"}
    reserved = 3
    for i in range(n_special):
        if i in named:
            tokens.append(named[i])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    types = [NORMAL] * n_normal + [CONTROL] * n_special
    return tokens, types, merges, n_normal


def q4_0_blocks(rng, rows, cols):
    """Random Q4_0 rows: per 32 weights an f16 scale d and 16 bytes of 4-bit q (w = d (q - 8))."""
    nb = rows * cols // 32
    blocks = np.empty((nb, 18), dtype=np.uint8)
    blocks[:, 2:] = np.frombuffer(rng.bytes(nb * 16), dtype=np.uint8).reshape(nb, 16)
    scale = 1.0 / (np.sqrt(cols) * 4.6)
    d = (scale * (0.5 + rng.random(nb, dtype=np.float32))).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(nb, 2)
    return blocks


def q8_0_blocks(rng, rows, cols):
    """Random Q8_0 rows: per 32 weights an f16 scale d and 32 int8 q (w = d q)."""
    nb = rows * cols // 32
    blocks = np.empty((nb, 34), dtype=np.uint8)
    blocks[:, 2:] = np.frombuffer(rng.bytes(nb * 32), dtype=np.uint8).reshape(nb, 32)
    # -128 is a valid value the reference quantizer never writes.
    blocks[:, 2:][blocks[:, 2:] == 0x80] = 0x81
    scale = 1.0 / (np.sqrt(cols) * 73.0)
    d = (scale * (0.5 + rng.random(nb, dtype=np.float32))).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(nb, 2)
    return blocks


def q6_k_blocks(rng, rows, cols):
    """Random Q6_K rows: per 256 weights ql[128], qh[64], 16 int8 scales, f16 d
    (w = d scale (q - 32), q of 6 bits)."""
    nb = rows * cols // 256
    blocks = np.empty((nb, 210), dtype=np.uint8)
    blocks[:, :192] = np.frombuffer(rng.bytes(nb * 192), dtype=np.uint8).reshape(nb, 192)
    blocks[:, 192:208] = rng.integers(8, 16, size=(nb, 16), dtype=np.uint8)  # int8 scales 8..15
    scale = 1.0 / (np.sqrt(cols) * 18.5 * 11.5)
    d = (scale * (0.5 + rng.random(nb, dtype=np.float32))).astype(np.float16)
    blocks[:, 208:] = d.view(np.uint8).reshape(nb, 2)
    return blocks


def tensor_plan(a):
    """(name, ggml dims fastest first, type) in llama.cpp's order."""
    h, i, v = a.hidden, a.intermediate, a.vocab
    hd = h // a.heads
    q, kvd = a.heads * hd, a.kv_heads * hd
    m = TYPES[a.type]
    plan = [("token_embd.weight", (h, v), m)]
    for l in range(a.layers):
        p = f"blk.{l}."
        plan += [
            (p + "attn_norm.weight", (h,), F32),
            (p + "attn_q.weight", (h, q), m),
            (p + "attn_k.weight", (h, kvd), m),
            (p + "attn_v.weight", (h, kvd), m),
            (p + "attn_output.weight", (q, h), m),
            (p + "ffn_norm.weight", (h,), F32),
            (p + "ffn_gate.weight", (h, i), m),
            (p + "ffn_up.weight", (h, i), m),
            (p + "ffn_down.weight", (i, h), m),
        ]
    plan += [("output_norm.weight", (h,), F32),
             ("output.weight", (h, v), output_type(a))]
    return plan


def output_type(a):
    """llama-quantize keeps Q8_0's output Q8_0 and gives Q4_0's Q6_K."""
    if a.output_type:
        return TYPES.get(a.output_type, Q6_K)
    return Q8_0 if a.type == "q8_0" else Q6_K


def nbytes(dims, ty):
    n = int(np.prod(dims))
    per, size = BLOCK[ty]
    if dims[0] % per:
        raise SystemExit(f"a row of {dims[0]} does not split into blocks of {per}")
    return n // per * size


def pad(n):
    return (ALIGNMENT - n % ALIGNMENT) % ALIGNMENT


def metadata(a):
    tokens, types, merges, n_normal = vocabulary(a.vocab)
    hd = a.hidden // a.heads
    items = [
        kv("general.architecture", T_STRING, "llama"),
        kv("general.name", T_STRING, f"kiln random Llama-3.1-8B shape {a.type.upper()}"),
        kv("general.file_type", T_UINT32, FILE_TYPE[TYPES[a.type]]),
        kv("general.quantization_version", T_UINT32, 2),
        kv("llama.context_length", T_UINT32, a.context),
        kv("llama.embedding_length", T_UINT32, a.hidden),
        kv("llama.block_count", T_UINT32, a.layers),
        kv("llama.feed_forward_length", T_UINT32, a.intermediate),
        kv("llama.attention.head_count", T_UINT32, a.heads),
        kv("llama.attention.head_count_kv", T_UINT32, a.kv_heads),
        kv("llama.rope.dimension_count", T_UINT32, hd),
        kv("llama.rope.freq_base", T_FLOAT32, a.rope_theta),
        kv("llama.attention.layer_norm_rms_epsilon", T_FLOAT32, 1e-5),
        kv("llama.vocab_size", T_UINT32, a.vocab),
        kv("tokenizer.ggml.model", T_STRING, "gpt2"),
        kv("tokenizer.ggml.pre", T_STRING, "llama-bpe"),
        kv_array("tokenizer.ggml.tokens", T_STRING, tokens),
        kv_array("tokenizer.ggml.token_type", T_INT32, types),
        kv_array("tokenizer.ggml.merges", T_STRING, merges),
        kv("tokenizer.ggml.bos_token_id", T_UINT32, n_normal),
        kv("tokenizer.ggml.eos_token_id", T_UINT32, n_normal + 9),
        kv("tokenizer.ggml.eot_token_id", T_UINT32, n_normal + 9),
        kv("tokenizer.ggml.add_bos_token", T_BOOL, True),
    ]
    return items


def write(a):
    started = time.perf_counter()
    plan = tensor_plan(a)
    items = metadata(a)
    infos, offset = [], 0
    for name, dims, ty in plan:
        size = nbytes(dims, ty)
        infos.append(gstr(name) + struct.pack("<I", len(dims)) +
                     struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ty, offset))
        offset += size + pad(size)
    header = (GGUF_MAGIC + struct.pack("<IQQ", 3, len(plan), len(items)) + b"".join(items) +
              b"".join(infos))
    header += b"\0" * pad(len(header))
    total = len(header) + offset
    rng = np.random.default_rng(a.seed)
    tmp = a.path + ".partial"
    with open(tmp, "wb") as f:
        f.write(header)
        for name, dims, ty in plan:
            cols, rows = dims[0], int(np.prod(dims[1:]))
            if ty == F32:
                data = np.ones(cols * rows, dtype="<f4")
            else:
                make = {Q4_0: q4_0_blocks, Q8_0: q8_0_blocks, Q6_K: q6_k_blocks}[ty]
                data = make(rng, rows, cols)
            f.write(memoryview(data).cast("B"))
            f.write(b"\0" * pad(data.nbytes))
    if os.path.getsize(tmp) != total:
        raise SystemExit(f"wrote {os.path.getsize(tmp)} bytes, planned {total}")
    os.replace(tmp, a.path)
    print(f"wrote {a.path}: {total / 1e9:.2f} GB, {len(plan)} tensors, "
          f"{time.perf_counter() - started:.1f} s", flush=True)


def check(path):
    """Reads the header back: metadata, tensor table, and that the data fills the file."""
    with open(path, "rb") as f:
        buf = f.read(64 << 20)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string():
        nonlocal pos
        n = take("<Q")
        pos += n
        return buf[pos - n:pos].decode("utf-8")

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
              10: "<Q", 11: "<q", 12: "<d"}

    def value(t):
        if t == T_STRING:
            return string()
        if t == T_ARRAY:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    assert buf[:4] == GGUF_MAGIC, "not a GGUF file"
    pos = 4
    version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("<I"))
    end = 0
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        ty, off = take("<I"), take("<Q")
        assert off % ALIGNMENT == 0, name
        end = max(end, off + nbytes(dims, ty))
    data_start = pos + pad(pos)
    size = os.path.getsize(path)
    n_vocab = len(meta["tokenizer.ggml.tokens"])
    assert len(set(meta["tokenizer.ggml.tokens"])) == n_vocab, "duplicate tokens"
    assert len(meta["tokenizer.ggml.token_type"]) == n_vocab
    assert meta["llama.vocab_size"] == n_vocab
    tokens = set(meta["tokenizer.ggml.tokens"])
    for m in meta["tokenizer.ggml.merges"]:
        left, right = m.split(" ", 1)
        assert left in tokens and right in tokens and left + right in tokens, m
    assert data_start + end <= size <= data_start + end + ALIGNMENT, (data_start, end, size)
    print(f"{path}: GGUF v{version}, {n_tensors} tensors, {n_kv} keys, vocab {n_vocab}, "
          f"{len(meta['tokenizer.ggml.merges'])} merges, data {data_start}..{size}: ok")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--type", choices=sorted(TYPES), default="q4_0",
                   help="the matrices' block type")
    p.add_argument("--output-type", choices=["q6_k", "q4_0", "q8_0"],
                   help="output.weight's type (default: what llama-quantize gives)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="only read PATH's header back")
    a = p.parse_args()
    if not a.check:
        write(a)
    check(a.path)


if __name__ == "__main__":
    sys.exit(main())
