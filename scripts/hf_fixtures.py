#!/usr/bin/env python3
"""Hugging Face checkpoint fixtures: the tiny GGUF models of test/fixtures/tiny written back in
Hugging Face layout (the inverse of llama.cpp's convert_hf_to_gguf.py), so a test can load the
same weights from both formats and compare.

    python3 scripts/hf_fixtures.py [OUT_DIR]      (default test/fixtures/hf)

For llama, qwen2, qwen3 and gemma3 (from tiny-<arch>-f32.gguf) it writes OUT_DIR/<arch>/ with
config.json, model.safetensors (llama: two shards and model.safetensors.index.json),
tokenizer.json (byte-level BPE with the tiny vocabulary and merges), tokenizer_config.json and
generation_config.json. The inverse conversion: GGUF names → Hugging Face names, Llama's Q/K
rows back from interleaved to rotate-half order, Gemma's stored `1 + weight` norms back to
`weight`. It also writes OUT_DIR/llama-f16-256/, a width-256 llama stored in f16 (Q4_K needs
rows of 256). Requires the `gguf`, `safetensors` and `numpy` PyPI packages.
"""

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import gguf
    from safetensors.numpy import save_file
except ImportError:  # pragma: no cover
    sys.exit("hf_fixtures.py needs: pip install gguf safetensors numpy")

import tiny_gguf  # noqa: E402

ROOT = os.path.dirname(HERE)
LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_name(name, gemma):
    top = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, layer, module, suffix = name.split(".")
    if module == "ffn_norm":
        module = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
    elif module == "post_attention_norm":
        module = "post_attention_layernorm"
    else:
        module = LAYER[module]
    return f"model.layers.{layer}.{module}.{suffix}"


def unpermute(w, n_head):
    """convert_hf_to_gguf's permute, inverted: interleaved pairs back to rotate-half halves."""
    rows = w.shape[0]
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_json(tokens, merges, specials):
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in specials]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }


def write_dir(out, arch, cfg, tensors, shards=1):
    os.makedirs(out, exist_ok=True)
    tokens, _, merges = tiny_gguf.vocab()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n] for n in names}, os.path.join(out, "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save_file({n: tensors[n] for n in part}, os.path.join(out, file))
            weight_map.update({n: file for n in part})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=1)
    specials = [(0, "<|endoftext|>"), (1, "<|im_start|>"), (2, "<|im_end|>")]
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(tokens, merges, specials), f)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False, "bos_token": "<|endoftext|>",
                   "eos_token": "<|im_end|>", "chat_template": tiny_gguf.CHAT_TEMPLATE}, f,
                  indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f)
    print(out)


def from_gguf(path, arch, out):
    r = gguf.GGUFReader(path)
    meta = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer")}
    a = "llama" if arch == "llama" else arch
    k = lambda key: meta.get(f"{a}.{key}")  # noqa: E731
    gemma = arch == "gemma3"
    n_head, n_head_kv = k("attention.head_count"), k("attention.head_count_kv")
    d = k("embedding_length")
    head_dim = k("attention.key_length") or d // n_head
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    cfg = {
        "architectures": ["X"], "model_type": model_type, "hidden_size": d,
        "num_hidden_layers": k("block_count"), "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv, "intermediate_size": k("feed_forward_length"),
        "vocab_size": len(tiny_gguf.vocab()[0]), "max_position_embeddings": k("context_length"),
        "rms_norm_eps": k("attention.layer_norm_rms_epsilon"), "rope_theta": k("rope.freq_base"),
        "head_dim": head_dim, "tie_word_embeddings": True, "torch_dtype": "float32",
    }
    if gemma:
        cfg.update({"hidden_activation": "gelu_pytorch_tanh", "sliding_window": k("attention.sliding_window"),
                    "sliding_window_pattern": k("attention.sliding_window_pattern"),
                    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": head_dim,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None})
    else:
        cfg["hidden_act"] = "silu"
    tensors = {}
    for t in r.tensors:
        w = np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape.tolist())])
        name = t.name
        if arch == "llama" and (".attn_q.weight" in name or ".attn_k.weight" in name):
            w = unpermute(w, n_head if ".attn_q." in name else n_head_kv)
        if gemma and name.endswith("norm.weight"):
            w = w - 1.0
        tensors[hf_name(name, gemma)] = np.ascontiguousarray(w)
    write_dir(out, arch, cfg, tensors, shards=2 if arch == "llama" else 1)


def f16_256(out):
    """A width-256 llama in f16: quantization at load to Q4_K needs rows of 256."""
    rng = np.random.default_rng(7)
    d, n_ff, n_head, n_head_kv, n_layer = 256, 512, 4, 2, 1
    n_vocab = len(tiny_gguf.vocab()[0])
    hd = d // n_head
    m = lambda r, c: (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float16)  # noqa: E731
    n = lambda c: (1 + 0.05 * rng.standard_normal(c)).astype(np.float16)  # noqa: E731
    t = {"model.embed_tokens.weight": m(n_vocab, d), "model.norm.weight": n(d),
         "lm_head.weight": m(n_vocab, d)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": m(n_head * hd, d),
                  p + "self_attn.k_proj.weight": m(n_head_kv * hd, d),
                  p + "self_attn.v_proj.weight": m(n_head_kv * hd, d),
                  p + "self_attn.o_proj.weight": m(d, n_head * hd),
                  p + "mlp.gate_proj.weight": m(n_ff, d), p + "mlp.up_proj.weight": m(n_ff, d),
                  p + "mlp.down_proj.weight": m(d, n_ff), p + "input_layernorm.weight": n(d),
                  p + "post_attention_layernorm.weight": n(d)})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
           "num_hidden_layers": n_layer, "num_attention_heads": n_head,
           "num_key_value_heads": n_head_kv, "intermediate_size": n_ff, "vocab_size": n_vocab,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16"}
    write_dir(out, "llama", cfg, t)
    # the same weights quantized by gguf-py (llama.cpp's reference quantizers) as GGUF files
    for name, qt in [("q8_0", gguf.GGMLQuantizationType.Q8_0), ("q4_0", gguf.GGMLQuantizationType.Q4_0)]:
        path = os.path.join(out, f"gguf-{name}.gguf")
        w = gguf.GGUFWriter(path, "llama")
        w.add_context_length(256)
        w.add_embedding_length(d)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
        w.add_file_type(int(qt))
        tokens, types, merges = tiny_gguf.vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        inverse = {v: k for k, v in LAYER.items()}
        for hf, a in sorted(t.items()):
            a = a.astype(np.float32)
            if hf == "model.embed_tokens.weight":
                g = "token_embd.weight"
            elif hf == "model.norm.weight":
                g = "output_norm.weight"
            elif hf == "lm_head.weight":
                g = "output.weight"
            else:
                _, _, layer, rest = hf.split(".", 3)
                module, suffix = rest.rsplit(".", 1)
                module = "ffn_norm" if module == "post_attention_layernorm" else inverse[module]
                g = f"blk.{layer}.{module}.{suffix}"
                if module in ("attn_q", "attn_k"):
                    heads = n_head if module == "attn_q" else n_head_kv
                    rows = a.shape[0]
                    a = a.reshape(heads, 2, rows // heads // 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
            if a.ndim == 2:
                w.add_tensor(g, gguf.quants.quantize(a, qt), raw_dtype=qt)
            else:
                w.add_tensor(g, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        print(path)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "test", "fixtures", "hf")
    tiny = os.path.join(ROOT, "test", "fixtures", "tiny")
    for arch in ["llama", "qwen2", "qwen3", "gemma3"]:
        from_gguf(os.path.join(tiny, f"tiny-{arch}-f32.gguf"), arch, os.path.join(out, arch))
    f16_256(os.path.join(out, "llama-f16-256"))


if __name__ == "__main__":
    main()
