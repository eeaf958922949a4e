#!/usr/bin/env python3
"""Makes the tiny-architecture parity fixtures: tiny random-weight GGUFs of every family the
engine implements (scripts/tiny_gguf.py) and llama.cpp's greedy continuations of fixed token
prompts on them, with the top-5 log-probabilities at every generated position.

    LLAMA_CPP_BIN=/tmp/lcp/build/bin python3 scripts/tiny_parity.py [OUT_DIR]

OUT_DIR defaults to test/fixtures/tiny. It receives tiny-<arch>-f32.gguf for each family and
parity.json:

    {"llama.cpp": "<llama-server --version>",
     "models": {"qwen2": [{"prompt": [ids], "tokens": [ids],
                           "top": [[[id, logprob] x5] per generated token]}, ...]}}

llama-server runs each model once (-np 1, one thread, flash attention off: its CPU flash
attention accumulates values in f16, the engine in f32; LLAMA_SERVER_ARGS replaces "-fa off")
and answers /completion with the prompt given as token ids, temperature 0, ignore_eos and
n_probs 5 (log-probabilities of the raw logits, before ignore_eos's bias).
The engine's `tests/arch_parity.rs` teacher-forces the same tokens and compares.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gguf  # noqa: E402

N_PREDICT = 24
# llama-quantize types for the quantization fixtures (file name suffix = lower case)
QUANT_TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M",
               "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"]


def prompts(n_vocab):
    # fixed, printable-token prompts of several lengths: 40 crosses gemma2's window of 8
    # and the 32-token query tiles of the engine's attention
    out = []
    for seed, length in [(1, 3), (2, 9), (3, 17), (4, 40)]:
        x = seed * 7919
        ids = []
        for _ in range(length):
            x = (x * 1103515245 + 12345) % (1 << 31)
            ids.append(3 + x % (n_vocab - 3))
        out.append(ids)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def run_model(bin_dir, path, n_vocab, n_ctx=256):
    port = free_port()
    server = subprocess.Popen(
        [os.path.join(bin_dir, "llama-server"), "-m", path, "--port", str(port), "-np", "1",
         "-c", str(n_ctx), "-t", "1", "--no-warmup"] + os.environ.get("LLAMA_SERVER_ARGS", "-fa off").split(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.1)
        cases = []
        for p in prompts(n_vocab):
            r = post(port, {
                "prompt": p, "n_predict": N_PREDICT, "temperature": 0.0, "n_probs": 5,
                "cache_prompt": False, "ignore_eos": True, "return_tokens": True,
            })
            probs = r["completion_probabilities"]
            cases.append({
                "prompt": p,
                "tokens": [c["id"] for c in probs],
                "top": [[[t["id"], t["logprob"]] for t in c["top_logprobs"]] for c in probs],
            })
        return cases
    finally:
        server.terminate()
        server.wait()


def longrope(bin_dir, out, result, n_vocab):
    """Phi-3 LongRoPE: llama.cpp picks the long factors when the context exceeds the original
    512 positions (-c 1024) and the short ones otherwise (-c 256)."""
    path = tiny_gguf.write(os.path.join(out, "phi3-longrope.gguf"), "phi3", "f32", longrope=True)
    result["longrope"] = {str(c): run_model(bin_dir, path, n_vocab, n_ctx=c) for c in (1024, 256)}


def main():
    bin_dir = os.environ.get("LLAMA_CPP_BIN")
    if not bin_dir:
        sys.exit("set LLAMA_CPP_BIN to a llama.cpp build's bin directory")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "test", "fixtures", "tiny")
    os.makedirs(out, exist_ok=True)
    version = subprocess.run([os.path.join(bin_dir, "llama-server"), "--version"],
                             capture_output=True, text=True)
    result = {"llama.cpp": (version.stdout + version.stderr).strip().splitlines()[0],
              "models": {}}
    n_vocab = len(tiny_gguf.vocab()[0])
    for arch in tiny_gguf.ARCHS:
        path = tiny_gguf.write(os.path.join(out, f"tiny-{arch}-f32.gguf"), arch, "f32")
        result["models"][arch] = run_model(bin_dir, path, n_vocab)
        print(arch, [len(c["tokens"]) for c in result["models"][arch]])
    longrope(bin_dir, out, result, n_vocab)
    # every quantization type, made by llama-quantize from one F32 llama of width 256 (the
    # K-quants' and IQ4_XS's super-block)
    # (the F32 base is not kept: F32 is covered by the families above)
    tmp = tempfile.mkdtemp()
    base = tiny_gguf.write(os.path.join(tmp, "quant-f32.gguf"), "llama", "f32", d=256,
                           n_layer=2, n_head=4, n_head_kv=2, n_ff=256, std=float(
                               os.environ.get("TINY_QUANT_STD", "1.0")))
    result["quants"] = {}
    for t in QUANT_TYPES:
        path = os.path.join(out, f"quant-{t.lower()}.gguf")
        subprocess.run([os.path.join(bin_dir, "llama-quantize"), "--pure", base, path, t],
                       check=True, capture_output=True)
        result["quants"][t] = run_model(bin_dir, path, n_vocab)
        print(t, os.path.getsize(path))
    # files that must be refused with a message naming what is unsupported
    tiny_gguf.write(os.path.join(out, "refuse-extra-tensor.gguf"), "llama", "f32", d=32,
                    n_layer=1, n_ff=32, extra_tensor="blk.0.ffn_gate.bias")
    tiny_gguf.write(os.path.join(out, "refuse-yarn.gguf"), "llama", "f32", d=32, n_layer=1,
                    n_ff=32, rope_scaling="yarn")
    tiny_gguf.write(os.path.join(out, "linear-rope.gguf"), "llama", "f32", d=32, n_layer=1,
                    n_ff=32, rope_scaling="linear")
    with open(os.path.join(out, "parity.json"), "w") as f:
        json.dump(result, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
