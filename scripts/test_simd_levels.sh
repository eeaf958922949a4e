#!/usr/bin/env bash
# Runs the engine's kernel, parity (real and tiny models) and allocation tests once per SIMD level below the best one
# this CPU has (the full suite already ran at the best level), so every kernel path is
# exercised wherever the suite runs, and on a VNNI CPU the parity tests with each of its
# single-row decode kernels. Levels: avx512 (AVX512-VNNI), avx2, scalar.
# On a machine above AVX2 it then runs the whole ExUnit suite at avx2 too (~2.5 minutes:
# end to end what an AVX2-only CPU runs); LLAMA_CPP_EX_FULL_LEVELS=1 adds it at scalar
# (~14 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
levels=()
vnni=false
if [[ $flags =~ (avx512_vnni|avx512vnni) ]] && [[ $flags =~ avx512vl ]]; then
  levels+=(avx2)
  vnni=true
fi
if [[ $flags =~ avx2 ]]; then levels+=(scalar); fi
for level in "${levels[@]}"; do
  echo "==> engine kernel, parity and allocation tests with LLAMA_CPP_EX_SIMD=$level"
  LLAMA_CPP_EX_SIMD=$level cargo test --release --manifest-path native/Cargo.toml \
    -p llama_cpp_ex_engine --lib kernels
  LLAMA_CPP_EX_SIMD=$level cargo test --release --manifest-path native/Cargo.toml \
    -p llama_cpp_ex_engine --test kernels --test llama_parity --test gemma3_parity \
    --test allocations --test arch_parity --test kv_precision
done
if $vnni; then
  # the VNNI path runs a single row's products on one of two kernels by CPU (see
  # `kernels::single_row_on_one_group`): the parity and batch-invariance tests on each
  for kernel in wide group; do
    echo "==> engine parity tests with LLAMA_CPP_EX_DECODE_KERNEL=$kernel"
    LLAMA_CPP_EX_DECODE_KERNEL=$kernel cargo test --release --manifest-path native/Cargo.toml \
      -p llama_cpp_ex_engine --test llama_parity --test gemma3_parity --test arch_parity
  done
fi
for level in "${levels[@]}"; do
  if [ "$level" = avx2 ] || [ -n "${LLAMA_CPP_EX_FULL_LEVELS:-}" ]; then
    echo "==> ExUnit suite with LLAMA_CPP_EX_SIMD=$level"
    LLAMA_CPP_EX_SIMD=$level mix test
  fi
done
