#!/usr/bin/env python3
"""llama.cpp's embeddings of the two real models, for tests/embeddings.rs.

    LLAMA_CPP_BIN=/tmp/lcp/build/bin python3 scripts/embedding_fixtures.py

Runs `llama-embedding --pooling P --embd-normalize 2` on SmolLM2 and Gemma 3 for the texts
below and writes test/fixtures/embeddings.json ({model: {pooling: [[float]]}}).
"""

import json
import os
import subprocess

TEXTS = ["The capital of France is Paris.", "Rust is a systems programming language.",
         "hi", "def add(a, b):\n    return a + b"]
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}


def main():
    bin_dir = os.environ["LLAMA_CPP_BIN"]
    models = os.environ.get("LLAMA_CPP_EX_MODELS",
                            os.path.expanduser("~/.cache/llama_cpp_ex/models"))
    out = {"texts": TEXTS, "models": {}}
    for name, file in MODELS.items():
        out["models"][name] = {}
        for pooling in ["mean", "last", "cls"]:
            r = subprocess.run(
                [os.path.join(bin_dir, "llama-embedding"), "-m", os.path.join(models, file),
                 "--pooling", pooling, "--embd-normalize", "2", "--embd-separator", "\x1f",
                 "-p", "\x1f".join(TEXTS), "--embd-output-format", "json", "-t", "2"],
                capture_output=True, text=True, check=True)
            data = json.loads(r.stdout)["data"]
            out["models"][name][pooling] = [[round(x, 6) for x in d["embedding"]] for d in data]
            print(name, pooling, len(data), len(data[0]["embedding"]))
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with open(os.path.join(root, "test", "fixtures", "embeddings.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
