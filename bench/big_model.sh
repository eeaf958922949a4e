#!/usr/bin/env bash
# Speed at the size users run: makes a random-weight llama at Llama 3.2 1B shapes with
# SmolLM2's tokenizer (scripts/random_llama.py), quantizes it to Q4_K_M with llama.cpp's
# llama-quantize, and runs bench/generate.exs on it next to llama-bench (pp512, tg128, the
# read-bandwidth ceiling and the % of it reached).
#
#   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin [LLAMA_THREADS=2] [SHAPE=llama3.2-1b] \
#   [QUANT=Q4_K_M] bench/big_model.sh
#
# The files are cached in $LLAMA_CPP_EX_MODELS (default ~/.cache/llama_cpp_ex/models):
# random-<shape>-f16.gguf (2.4 GB for 1B) and random-<shape>-<quant>.gguf.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to the bin directory of a llama.cpp build}"
shape=${SHAPE:-llama3.2-1b}
quant=${QUANT:-Q4_K_M}
models=${LLAMA_CPP_EX_MODELS:-$HOME/.cache/llama_cpp_ex/models}
tokenizer=$models/SmolLM2-135M-Instruct.Q4_1.gguf
f16=$models/random-$shape-f16.gguf
out=$models/random-$shape-$(echo "$quant" | tr 'A-Z' 'a-z').gguf

[ -f "$tokenizer" ] || python3 scripts/fetch_models.py
python3 -c "import gguf, numpy" 2>/dev/null || python3 -m pip install -q gguf numpy
[ -f "$f16" ] || python3 scripts/random_llama.py "$tokenizer" "$f16" --shape "$shape"
[ -f "$out" ] || LD_LIBRARY_PATH=$LLAMA_CPP_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  "$LLAMA_CPP_BIN/llama-quantize" "$f16" "$out" "$quant" 2>&1 | tail -2
echo "== $out ($(du -h "$out" | cut -f1))"
LLAMA_MODEL_PATH=$out mix run bench/generate.exs
