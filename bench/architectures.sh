#!/usr/bin/env bash
# Speed of every decoder family on the same shapes and tensor type: random-weight GGUFs of
# SmolLM2's dimensions (width 576, 30 layers, 9 heads / 3 KV heads, FFN 1536; Qwen 3's head is
# twice as wide, as in its real models) in Q4_0 with a ~100-token vocabulary (so the output
# head does not count), each run through bench/generate.exs (and llama-bench when
# LLAMA_CPP_BIN is set).
#
#   [LLAMA_CPP_BIN=/path/to/llama.cpp/bin] [TYPE=q4_0] bench/architectures.sh
set -euo pipefail
cd "$(dirname "$0")/.."
type="${TYPE:-q4_0}"
dir="${TMPDIR:-/tmp}/llama_cpp_ex_archbench"
mkdir -p "$dir"
python3 - "$dir" "$type" <<'PY'
import os, sys
sys.path.insert(0, "scripts")
import tiny_gguf
out, t = sys.argv[1], sys.argv[2]
for a in ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]:
    p = os.path.join(out, f"{a}-{t}.gguf")
    if not os.path.exists(p):
        tiny_gguf.write(p, a, t, d=576, n_layer=30, n_head=9, n_head_kv=3, n_ff=1536, std=1.0,
                        n_ctx=4096)
PY
for a in llama qwen2 qwen3 phi3 gemma2 gemma3; do
  echo "== $a ($type)"
  LLAMA_MODEL_PATH="$dir/$a-$type.gguf" mix run bench/generate.exs | grep -E '^\||^decode'
done
