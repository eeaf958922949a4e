#!/usr/bin/env bash
# The single-stream and server benchmarks once per SIMD level this CPU has (avx512 = AVX-512
# VNNI, avx2), side by side with llama.cpp when LLAMA_CPP_BIN is set (llama.cpp runs its own
# best kernels for the CPU in every row: the comparison for the avx2 rows is our AVX2 path
# against llama.cpp at full strength).
#
#   LLAMA_CPP_BIN=/tmp/lcp/build/bin LLAMA_THREADS=2 bench/simd_levels.sh [LEVEL...]
#
# LLAMA_CPP_BIN_AVX2 (a llama.cpp built with GGML_NATIVE=OFF GGML_AVX512=OFF, i.e. what an
# AVX2-only CPU runs) adds a second llama.cpp column to the avx2 rows' single-stream tables.
set -euo pipefail
cd "$(dirname "$0")/.."
models="${LLAMA_CPP_EX_MODELS:-$HOME/.cache/llama_cpp_ex/models}"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
levels=("$@")
if [ ${#levels[@]} -eq 0 ]; then
  if [[ $flags =~ (avx512_vnni|avx512vnni) ]] && [[ $flags =~ avx512vl ]]; then levels+=(avx512); fi
  if [[ $flags =~ avx2 ]]; then levels+=(avx2); fi
fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), threads: ${LLAMA_THREADS:-2}"
for level in "${levels[@]}"; do
  for m in SmolLM2-135M-Instruct.Q4_1.gguf gemma-3-270m-q4_k_m.gguf; do
    echo; echo "== LLAMA_CPP_EX_SIMD=$level  $m"
    avx2_bin=""
    if [ "$level" = avx2 ]; then avx2_bin="${LLAMA_CPP_BIN_AVX2:-}"; fi
    LLAMA_CPP_EX_SIMD=$level LLAMA_MODEL_PATH="$models/$m" LLAMA_THREADS="${LLAMA_THREADS:-2}" \
      LLAMA_CPP_BIN_AVX2="$avx2_bin" mix run bench/generate.exs
  done
  echo; echo "== LLAMA_CPP_EX_SIMD=$level  server, SmolLM2"
  LLAMA_CPP_EX_SIMD=$level BENCH_LEVELS=1,8 BENCH_SKIP_PREFIX=1 LLAMA_THREADS="${LLAMA_THREADS:-2}" \
    mix run bench/server_concurrent.exs
done
