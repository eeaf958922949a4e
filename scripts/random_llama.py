#!/usr/bin/env python3
"""A llama-architecture GGUF at a real model's shapes with random F16 weights and the tokenizer
of an existing GGUF: a file of the size users run, for speed measurements (its text is noise).

    python3 scripts/random_llama.py TOKENIZER_GGUF OUT_F16_GGUF [--shape llama3.2-1b|smollm2-135m]

llama3.2-1b: 2048 wide, 16 layers, 32/8 heads, FFN 8192, tied head out; smollm2-135m: 576
wide, 30 layers, 9/3 heads, FFN 1536. Weights are seeded normal draws scaled by 1/sqrt(fan-in),
norms are ones, so activations stay finite at every layer. Quantize the result with
llama-quantize (bench/big_model.sh does both). Requires the `gguf` and `numpy` PyPI packages.
"""

import argparse

import gguf
import numpy as np

SHAPES = {
    # n_embd, n_layer, n_head, n_head_kv, n_ff, rope base
    "llama3.2-1b": (2048, 16, 32, 8, 8192, 500000.0),
    "smollm2-135m": (576, 30, 9, 3, 1536, 100000.0),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer_gguf")
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama3.2-1b", choices=sorted(SHAPES))
    args = ap.parse_args()
    n_embd, n_layer, n_head, n_kv, n_ff, rope_base = SHAPES[args.shape]
    head_dim = n_embd // n_head

    src = gguf.GGUFReader(args.tokenizer_gguf)
    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name(f"random-{args.shape}")
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(src, w)
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)

    rng = np.random.default_rng(0)

    def rand(name, rows, cols, scale=None):
        s = scale if scale is not None else 1.0 / np.sqrt(cols)
        x = rng.standard_normal((rows, cols), dtype=np.float32) * s
        w.add_tensor(name, x.astype(np.float16))

    def ones(name):
        w.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    rand("token_embd.weight", n_vocab, n_embd, scale=0.02)
    ones("output_norm.weight")
    for i in range(n_layer):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight")
        ones(p + "ffn_norm.weight")
        rand(p + "attn_q.weight", n_embd, n_embd)
        rand(p + "attn_k.weight", n_kv * head_dim, n_embd)
        rand(p + "attn_v.weight", n_kv * head_dim, n_embd)
        rand(p + "attn_output.weight", n_embd, n_embd)
        rand(p + "ffn_gate.weight", n_ff, n_embd)
        rand(p + "ffn_up.weight", n_ff, n_embd)
        rand(p + "ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(args.out)


def copy_tokenizer(src, w):
    """Every `tokenizer.*` key of `src`, as it is."""
    for f in src.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if f.types[1] == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_array(f.name, vals)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(f.name, bytes(f.parts[f.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(f.name, f.parts[f.data[0]].tolist()[0], kind)


if __name__ == "__main__":
    main()
