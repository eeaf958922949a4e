#!/usr/bin/env python3
"""Tiny random-weight GGUF models for tests, parity checks and fuzz seeds.

    python3 scripts/tiny_gguf.py OUT_DIR [--arch ARCH] [--type f32|f16|q8_0|q4_0|q4_1]

ARCH: llama, llama3 (llama with rope_freqs and an untied head), qwen2 (Q/K/V biases), qwen3
(Q/K norms, head_dim != n_embd / n_head), phi3 (fused attn_qkv and gate+up), gemma2
(soft-capping, post-norms, a sliding window of 8 on every other layer), gemma3,
gemma-embedding (EmbeddingGemma: Gemma 3 with bidirectional attention, a symmetric window of 8
on every other layer, mean pooling and sentence-transformers' dense_2 / dense_3 projections).

writes OUT_DIR/tiny-<arch>-<type>.gguf: a model of a few KB with a byte-level BPE vocabulary
of the printable ASCII characters (space as "Ġ") and three special tokens, random weights
(seeded), and llama.cpp's metadata keys, so that both llama.cpp and LlamaCppEx load it.
Requires the `gguf` and `numpy` PyPI packages.
"""

import argparse
import os
import sys

import numpy as np

try:
    import gguf
except ImportError:  # pragma: no cover
    sys.exit("tiny_gguf.py needs the gguf package: pip install gguf numpy")

TYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocab():
    chars = [chr(c) for c in range(33, 127)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\u0120"] + chars
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    # a few merges so that BPE has work to do
    merges = ["h e", "l l", "o \u0120", "he ll", "t h"]
    tokens += ["he", "ll", "o\u0120", "hell", "th"]
    types += [gguf.TokenType.NORMAL] * 5
    return tokens, types, merges


ARCHS = ["llama", "llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma-embedding"]


def write(path, arch="llama", qtype="f32", d=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128,
          seed=0, extra_tensor=None, rope_scaling=None, std=None, longrope=False, n_ctx=256, rerank=False):
    """Writes one model. `extra_tensor` (a name) adds a tensor no architecture reads, and
    `rope_scaling` a `rope.scaling.type`: files that must be refused. `rerank`: a
    Qwen3-Reranker-style model (pooling rank, `cls.output` over the labels yes/no, a rerank
    chat template). `longrope` (phi3): Phi-3's
    LongRoPE factor sets (`rope_factors_long` / `rope_factors_short`), an original context of 64
    and the converter's attention factor (a trained context of 2048 = 4 × 512). `std`: weights drawn
    with standard deviation std/sqrt(columns) (a well-conditioned network, where rounding
    differences stay small) instead of 0.2."""
    rng = np.random.default_rng(seed + ARCHS.index(arch))
    tokens, types, merges = vocab()
    n_vocab = len(tokens)
    variant = arch
    arch = "llama" if arch == "llama3" else arch
    gemma = arch in ("gemma2", "gemma3", "gemma-embedding")
    gemma3 = arch in ("gemma3", "gemma-embedding")
    # Qwen 3 decouples the head size from the width, as its real models do
    head_dim = 2 * d // n_head if arch == "qwen3" else d // n_head
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(2048 if longrope else n_ctx)
    w.add_embedding_length(d)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    w.add_rope_freq_base(1000000.0 if arch.startswith("qwen") else 10000.0)
    w.add_rope_dimension_count(head_dim)
    if rope_scaling:
        w.add_string(f"{arch}.rope.scaling.type", rope_scaling)
        w.add_float32(f"{arch}.rope.scaling.factor", 4.0)
    if gemma or arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(32)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)
    if arch == "gemma-embedding":
        w.add_sliding_window(8)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)
        w.add_pooling_type(gguf.PoolingType.MEAN)
        w.add_uint32(f"{arch}.dense_2_feat_in", d)
        w.add_uint32(f"{arch}.dense_2_feat_out", 2 * d)
        w.add_uint32(f"{arch}.dense_3_feat_in", 2 * d)
        w.add_uint32(f"{arch}.dense_3_feat_out", d)
    if arch == "gemma2":
        w.add_sliding_window(8)
        w.add_float32(f"{arch}.attn_logit_softcapping", 2.0)
        w.add_float32(f"{arch}.final_logit_softcapping", 3.0)
    w.add_file_type(int(TYPES[qtype]) if qtype != "f32" else 0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def matrix(name, rows, cols, quantize=True):
        scale = 0.2 if std is None else std / np.sqrt(cols)
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        t = TYPES[qtype] if quantize else gguf.GGMLQuantizationType.F32
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)

    def norm(name, n):
        # Gemma files store norm weights with llama.cpp's +1 already applied, so 1 + noise
        # is a plausible norm for every family
        w.add_tensor(name, (1.0 + rng.standard_normal(n) * 0.05).astype(np.float32))

    def vector(name, n, scale=0.1):
        w.add_tensor(name, (rng.standard_normal(n) * scale).astype(np.float32))

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    matrix("token_embd.weight", n_vocab, d)
    norm("output_norm.weight", d)
    if rerank:
        w.add_uint32(f"{arch}.pooling_type", 4)
        w.add_array(f"{arch}.classifier.output_labels", ["yes", "no"])
        w.add_string("tokenizer.chat_template.rerank",
                     "<|im_start|>system\njudge<|im_end|>\n<|im_start|>user\nq: {query}\nd: {document}<|im_end|>\n<|im_start|>assistant\n")
    if longrope:
        # convert_hf_to_gguf's Phi-3 128k keys: factors per rotated pair for contexts beyond
        # the original one and within it, and sqrt(1 + ln(scale) / ln(original)) for scale 4
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", 512)
        w.add_float32(f"{arch}.rope.scaling.attn_factor", float(np.sqrt(1 + np.log(4) / np.log(512))))
        w.add_tensor("rope_factors_long.weight", np.linspace(1.0, 6.0, head_dim // 2).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 1.5, head_dim // 2).astype(np.float32))
    if variant == "llama3":
        matrix("output.weight", n_vocab, d)
        # Llama 3's per-dimension rope factors: 1 for high frequencies, up to 8 for low ones
        w.add_tensor("rope_freqs.weight",
                     np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32))
    for i in range(n_layer):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight", d)
        if arch == "phi3":
            matrix(f"{b}.attn_qkv.weight", q_dim + 2 * kv_dim, d)
        else:
            matrix(f"{b}.attn_q.weight", q_dim, d)
            matrix(f"{b}.attn_k.weight", kv_dim, d)
            matrix(f"{b}.attn_v.weight", kv_dim, d)
        if arch == "qwen2":
            vector(f"{b}.attn_q.bias", q_dim)
            vector(f"{b}.attn_k.bias", kv_dim)
            vector(f"{b}.attn_v.bias", kv_dim)
        matrix(f"{b}.attn_output.weight", d, q_dim)
        norm(f"{b}.ffn_norm.weight", d)
        if arch == "phi3":
            matrix(f"{b}.ffn_up.weight", 2 * n_ff, d)
        else:
            matrix(f"{b}.ffn_gate.weight", n_ff, d)
            matrix(f"{b}.ffn_up.weight", n_ff, d)
        matrix(f"{b}.ffn_down.weight", d, n_ff)
        if gemma3 or arch == "qwen3":
            norm(f"{b}.attn_q_norm.weight", head_dim)
            norm(f"{b}.attn_k_norm.weight", head_dim)
        if gemma:
            norm(f"{b}.post_attention_norm.weight", d)
            norm(f"{b}.post_ffw_norm.weight", d)

    if rerank:
        matrix("cls.output.weight", 2, d, quantize=False)
    if arch == "gemma-embedding":
        matrix("dense_2.weight", 2 * d, d, quantize=False)
        matrix("dense_3.weight", d, 2 * d, quantize=False)
    if extra_tensor:
        vector(extra_tensor, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=ARCHS, action="append")
    p.add_argument("--type", choices=sorted(TYPES), action="append")
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    for arch in a.arch or ["llama"]:
        for t in a.type or ["f32"]:
            print(write(os.path.join(a.out_dir, f"tiny-{arch}-{t}.gguf"), arch, t))


if __name__ == "__main__":
    main()
