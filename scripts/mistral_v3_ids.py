#!/usr/bin/env python3
"""Writes tests/fixtures/mistral-v3-ids.json: the token ids SentencePiece, the
library Mistral's own tokenizer runs, gives for each input of llama.cpp's
SentencePiece test file (by position: the texts stay in the pinned archive)
and for kiln's own inputs below, with Mistral 7B v0.3's v3 model from the
pinned mistral-common archive (`reference_files` in nix/pins.json; `cargo
xtask reference-files` unpacks both into one folder). No BOS is added:
tests/released_files.rs compares `encode_rendered`, which adds none.

    /tmp/sp/bin/python scripts/mistral_v3_ids.py "$KILN_REFERENCE_FILES" \\
        > tests/fixtures/mistral-v3-ids.json

(set-up: scripts/requirements-sentencepiece.txt)
"""
import hashlib
import json
import sys
from pathlib import Path

import sentencepiece

MODEL = "mistral_instruct_tokenizer_240323.model.v3"
INPUTS = "ggml-vocab-llama-spm.gguf.inp"
SEPARATOR = "\n__ggml_vocab_test__\n"

# Inputs of kiln's own: accents and punctuation, runs of spaces, tabs and
# new lines, digits, scripts without spaces, emoji (byte fallback), code.
OWN = [
    "Mistral parle français : « Où est la bibliothèque ? »",
    "  two leading spaces, a tab\there and\nnew lines\n\n",
    "Numbers 1234567890 and 3.14159, $42.00 or 1e-9",
    "日本語のテキストと emoji 🦀🔥",
    "def square(x):\n    return x ** 2  # comment",
    "Ünïcödé ﬁ ligature and zero\u200bwidth",
]


def main() -> None:
    folder = Path(sys.argv[1])
    model = folder / MODEL
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    texts = (folder / INPUTS).read_text(encoding="utf-8").split(SEPARATOR)
    assert texts.pop() == "", "the inputs end with a separator"

    def encode(text: str) -> list:
        return processor.encode(text, add_bos=False, add_eos=False)

    print(json.dumps({
        "_comment": "Made by scripts/mistral_v3_ids.py: SentencePiece's ids for "
                    "Mistral 7B v0.3's v3 model; `inputs` by position in the file named.",
        "model": MODEL,
        "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "sentencepiece": sentencepiece.__version__,
        "inputs_file": INPUTS,
        "inputs": [encode(t) for t in texts],
        "own": [{"text": t, "ids": encode(t)} for t in OWN],
    }, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
