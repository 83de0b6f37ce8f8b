#!/usr/bin/env python3
"""Writes DIR/tokenizer.json for a model folder of random weights (as
`kiln-bench-decode --write-model` makes): a word-level tokenizer with one
word `tN` per id of the config's vocabulary, so that whatever id a random
model picks decodes to text, and kiln-server can serve it.

    python3 scripts/word_tokenizer.py /tmp/kiln-tinyllama-1.1b
"""
import json
import os
import sys

folder = sys.argv[1]
with open(os.path.join(folder, "config.json")) as f:
    vocab = json.load(f)["vocab_size"]
tokenizer = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"},
}
with open(os.path.join(folder, "tokenizer.json"), "w") as f:
    json.dump(tokenizer, f)
