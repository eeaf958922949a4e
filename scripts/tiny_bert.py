#!/usr/bin/env python3
"""A tiny random-weight BERT GGUF (llama.cpp's `bert` architecture and WordPiece `bert`
vocabulary, written as convert_hf_to_gguf.py's BertModel writes them: phantom-space tokens,
`blk.N.attn_output_norm` etc.) and llama.cpp's token ids and mean-pooled embeddings on it.

    LLAMA_CPP_BIN=/tmp/lcp/build/bin python3 scripts/tiny_bert.py [OUT_DIR]

writes OUT_DIR/tiny-bert-f32.gguf and OUT_DIR/bert.json ({"texts", "ids", "embeddings"}),
OUT_DIR defaulting to test/fixtures/tiny. Needs the gguf and numpy PyPI packages.
"""

import json
import os
import subprocess
import sys

import numpy as np
import gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello world!", "the cats jumped, singing.", "A QUICK test: 42 dogs?", "x"]


def vocab():
    control = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    digits = [str(d) for d in range(10)]
    punct = list(".,!?:'-")
    words = ["the", "cat", "dog", "hello", "world", "test", "quick", "jump", "sing"]
    pieces = ["s", "ed", "ing", "er"]
    # phantom-space form: "▁word" starts a word, a bare piece continues one
    tokens = control + ["\u2581" + t for t in letters + digits + punct + words]
    tokens += letters + digits + [p for p in pieces if p not in letters]
    types = [gguf.TokenType.CONTROL] * len(control) + [gguf.TokenType.NORMAL] * (len(tokens) - len(control))
    return tokens, types


def write(path, d=32, n_layer=2, n_head=4, n_ff=64, n_pos=64, rerank=False):
    """`rerank`: a cross-encoder (pooling RANK, classification head `cls` + `cls.output`)."""
    rng = np.random.default_rng(12 if rerank else 11)
    tokens, types = vocab()
    w = gguf.GGUFWriter(path, "bert")
    w.add_context_length(n_pos)
    w.add_embedding_length(d)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK if rerank else gguf.PoolingType.MEAN)
    w.add_file_type(0)
    w.add_token_type_count(2)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_unk_token_id(1)
    w.add_sep_token_id(3)
    w.add_pad_token_id(0)
    w.add_uint32("tokenizer.ggml.cls_token_id", 2)
    w.add_bos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    w.add_mask_token_id(4)
    m = lambda r, c: (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32)  # noqa: E731
    v = lambda n, s=0.1: (rng.standard_normal(n) * s).astype(np.float32)  # noqa: E731
    one = lambda n: (1 + rng.standard_normal(n) * 0.05).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", m(len(tokens), d) * 4)
    w.add_tensor("token_types.weight", m(2, d))
    w.add_tensor("position_embd.weight", m(n_pos, d))
    w.add_tensor("token_embd_norm.weight", one(d))
    w.add_tensor("token_embd_norm.bias", v(d))
    if rerank:
        w.add_tensor("cls.weight", m(d, d))
        w.add_tensor("cls.bias", v(d))
        w.add_tensor("cls.output.weight", m(1, d) * 3)
        w.add_tensor("cls.output.bias", v(1))
    for i in range(n_layer):
        b = f"blk.{i}."
        for name, (r, c) in [("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)),
                             ("attn_output", (d, d)), ("ffn_up", (n_ff, d)), ("ffn_down", (d, n_ff))]:
            w.add_tensor(b + name + ".weight", m(r, c))
            w.add_tensor(b + name + ".bias", v(r))
        for name in ["attn_output_norm", "layer_output_norm"]:
            w.add_tensor(b + name + ".weight", one(d))
            w.add_tensor(b + name + ".bias", v(d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


RERANK_QUERY = "the quick cat"
RERANK_DOCS = ["a cat jumped", "hello world", "the dogs sing", "quick test 42"]


def rerank_scores(bin_dir, out, path=None):
    """llama-server --rerank's /v1/rerank relevance scores (document order) on a tiny
    cross-encoder (the BERT one unless `path` names another)."""
    import socket
    import time
    import urllib.request

    if path is None:
        path = os.path.join(out, "tiny-bert-rerank-f32.gguf")
        write(path, rerank=True)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = subprocess.Popen([os.path.join(bin_dir, "llama-server"), "-m", path, "--rerank",
                               "--port", str(port), "-t", "1", "-c", "256", "--no-warmup"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except Exception:
                time.sleep(0.1)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/rerank",
            data=json.dumps({"query": RERANK_QUERY, "documents": RERANK_DOCS}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            results = json.load(r)["results"]
    finally:
        server.terminate()
        server.wait()
    scores = [0.0] * len(RERANK_DOCS)
    for item in results:
        scores[item["index"]] = item["relevance_score"]
    return {"query": RERANK_QUERY, "documents": RERANK_DOCS, "scores": scores}


# longer than the tiny EmbeddingGemma's window of 8, so the symmetric window matters
GEMMA_TEXTS = ["hello there, general kenobi", "the quick brown fox jumps over the lazy dog", "x"]


def embedding(bin_dir, path, text):
    """llama-embedding's mean-pooled, L2-normalised vector of `text`."""
    r = subprocess.run([os.path.join(bin_dir, "llama-embedding"), "-m", path, "-p", text, "--pooling", "mean",
                        "--embd-normalize", "2", "--embd-output-format", "array", "-t", "1"],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout[r.stdout.index("[["):])[0]


def main():
    bin_dir = os.environ.get("LLAMA_CPP_BIN") or sys.exit("set LLAMA_CPP_BIN")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "test", "fixtures", "tiny")
    path = os.path.join(out, "tiny-bert-f32.gguf")
    write(path)
    result = {"texts": TEXTS, "ids": [], "embeddings": []}
    for t in TEXTS:
        r = subprocess.run([os.path.join(bin_dir, "llama-tokenize"), "-m", path, "-p", t, "--ids", "--log-disable"],
                           capture_output=True, text=True, check=True)
        result["ids"].append(json.loads(r.stdout.strip().splitlines()[-1]))
        result["embeddings"].append(embedding(bin_dir, path, t))
    result["rerank"] = rerank_scores(bin_dir, out)
    # a Qwen3-Reranker-style decoder: last token, cls.output over yes/no, softmax
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tiny_gguf
    qwen = os.path.join(out, "tiny-qwen3-rerank-f32.gguf")
    tiny_gguf.write(qwen, "qwen3", "f32", std=1.0, rerank=True)
    result["qwen3_rerank"] = rerank_scores(bin_dir, out, qwen)
    # EmbeddingGemma-style: bidirectional Gemma 3, symmetric windows, mean pooling, dense_2/3
    gemma = os.path.join(out, "tiny-gemma-embedding-f32.gguf")
    tiny_gguf.write(gemma, "gemma-embedding", "f32", std=1.0)
    result["gemma_embedding"] = {"texts": GEMMA_TEXTS, "embeddings": [
        embedding(bin_dir, gemma, t) for t in GEMMA_TEXTS]}
    with open(os.path.join(out, "bert.json"), "w") as f:
        json.dump(result, f)
    print(path, result["ids"])


if __name__ == "__main__":
    main()
