#!/usr/bin/env python3
"""Fixtures for kiln's GGUF dequantization, from the `gguf` package's reference
dequantizers (gguf.quants.dequantize, which ships with llama.cpp).

    python3 -m venv /tmp/gguf-venv
    /tmp/gguf-venv/bin/pip install --require-hashes -r scripts/requirements-gguf.txt
    /tmp/gguf-venv/bin/python scripts/gguf_dequant_fixture.py MODEL.gguf tests/fixtures/gguf

writes, into the fixture folder:
- `<model>.dequant.json`: for every tensor of MODEL.gguf, its type, dims and
  the sha256 of its dequantized f32 values (little-endian bytes);
- `synthetic.gguf`: one small tensor of each type kiln reads (the K-quants
  with random bytes and finite scales, the others quantized from random
  values by gguf.quants.quantize), and `synthetic.json`: each tensor's
  dequantized values as f32 bit patterns.
"""

import hashlib
import json
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of the f16 scales in one block, which random bytes must not
# make inf or NaN (those would compare by payload, not by value).
K_SCALES = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def f32_sha256(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values, dtype="<f4").tobytes()).hexdigest()


def model_fixture(model: Path, out: Path) -> None:
    reader = gguf.GGUFReader(model)
    tensors = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        tensors[t.name] = {
            "type": t.tensor_type.name,
            "dims": [int(d) for d in t.shape],
            "sha256": f32_sha256(values),
        }
    lines = [f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(tensors.items())]
    header = f'{{"source": {json.dumps(model.name)}, "gguf": "{version("gguf")}", "tensors": {{\n'
    name = model.name.removesuffix(".gguf") + ".dequant.json"
    (out / name).write_text(header + ",\n".join(lines) + "\n}}\n")


def synthetic(out: Path) -> None:
    rng = np.random.default_rng(14)
    rows, cols = 2, 256
    writer = gguf.GGUFWriter(out / "synthetic.gguf", "llama")
    expected = {}
    for name in TYPES:
        qtype = T[name]
        if name in K_SCALES:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
            for offset in K_SCALES[name]:
                scales = rng.uniform(-0.05, 0.05, size=raw.shape[0]).astype(np.float16)
                raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
            data = raw.reshape(rows, -1)
        else:
            values = rng.standard_normal((rows, cols)).astype(np.float32)
            data = quantize(values, qtype)
        # F32 and F16 arrays carry their type; the others are bytes of `qtype`.
        raw = name not in ("F32", "F16")
        writer.add_tensor(name.lower(), data, raw_shape=data.shape if raw else None, raw_dtype=qtype if raw else None)
        values = dequantize(data, qtype).astype(np.float32, copy=False).reshape(-1)
        expected[name.lower()] = {"type": name, "bits": values.view("<u4").tolist()}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (out / "synthetic.json").write_text(json.dumps(expected) + "\n")


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    model_fixture(model, out)
    synthetic(out)


if __name__ == "__main__":
    main()
