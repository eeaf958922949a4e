#!/usr/bin/env bash
# The GPU check, built here and run on the GPU machine:
#
#   scripts/gpu_check.sh pack   here (no GPU needed): builds the engine's GPU test binaries and
#                               its bench with the `cuda` feature (the CUDA 13.0 toolkit from
#                               PyPI wheels, scripts/cuda13_from_wheels.sh), and packs into
#                               .gpu/ what the GPU machine needs: the binaries xz-compressed,
#                               a tokenizer-only GGUF, the random-model generator with its
#                               `gguf` package, and llama.cpp's source for the anchor.
#   scripts/gpu_check.sh run    on the GPU machine (the device tool, carry [".gpu"]): parity of
#                               every tiny architecture and quantization type against
#                               llama.cpp's fixtures on the GPU, the device cache's sharing,
#                               windows and batch invariance, with the engine's CUDA kernels
#                               on (each alone, then none, where they fail), then pp512 / tg128 of the engine
#                               next to llama.cpp's CUDA build (made there meanwhile) on random
#                               models at Llama 3.2 1B (Q4_K_M) and SmolLM2 135M (Q4_1) shapes,
#                               32 streams next to llama-batched-bench, the graph probe, one
#                               decode step's kernels under Nsight Compute; then, while
#                               GPU_CHECK_BUDGET_S (default 420) allows, the host's
#                               CPU cores at 4, 8 and 16 threads: the engine's CPU path against
#                               llama.cpp's CPU backend (GPU hidden) on the same files.
#                               A summary ends the output ($OUT/summary.txt); every log comes
#                               back in $OUT/logs.tar.gz.
#   scripts/gpu_check.sh probe  `examples/graph_probe.rs` alone: a decode step of candle's CUDA
#                               ops at 1B shapes, eager and replayed as one CUDA graph.
#   scripts/gpu_check.sh parity the parity half of `run` alone (under a minute): after a change
#                               to the tests or the tensor path, with the test binaries
#                               repacked (`pack`, or `pack tests`).
#   scripts/gpu_check.sh pack cores
#                               here, without the CUDA toolkit (minutes, not the CUDA build's
#                               half hour): the CPU build of the engine's bench and the rest of
#                               what `cores` needs.
#   scripts/gpu_check.sh cores  on the GPU machine, its host's CPU cores alone (~8 min, no
#                               GPU used): llama.cpp's CPU build made there, the same random
#                               models as `run`, the pool's cost a call and how decode-sized
#                               products split at 4, 8 and 16 threads (`examples/pool_probe.rs`),
#                               and at each of CORES_THREADS (default
#                               "16 8 4") pp512 / tg128 next to llama-bench, the share of the
#                               read ceiling at that thread count, and at the most threads
#                               where a decode step's time goes and the AVX2 level. For issue
#                               43's many-core targets when the CUDA pack is not ready.
#
# Environment (pack): CUDA_PREFIX (default ~/.cache/llama_cpp_ex/cuda13), CUDA_COMPUTE_CAP
# (default 90: H100/H200), LLAMA_CPP_SRC (llama.cpp's unpacked source, default the one
# ../shared/tools/build_llamacpp.sh unpacks under /tmp/lcp).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PACK="$ROOT/.gpu"
MODE="${1:-}"

pack() {
  local manifest=(--quiet --manifest-path "$ROOT/native/Cargo.toml")
  if [ "${1:-}" = cores ]; then
    # the CPU build: its cargo target directory is the one CI and `make` share
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/llama_cpp_ex/cargo-target}"
    rm -rf "$PACK" && mkdir -p "$PACK"
    local ex
    for ex in decode_profile pool_probe; do
      cargo build "${manifest[@]}" --release -p llama_cpp_ex_engine --example "$ex"
      xz -T2 -6 -c "$CARGO_TARGET_DIR/release/examples/$ex" > "$PACK/$ex.xz"
    done
    pack_models_and_anchor
    return
  fi
  local prefix="${CUDA_PREFIX:-$HOME/.cache/llama_cpp_ex/cuda13}"
  if [ ! -f "$prefix/env.sh" ]; then
    # the toolkit's libcuda stub is made from cudarc's source, which a CPU build never fetched
    cargo fetch --quiet --manifest-path "$ROOT/native/Cargo.toml"
    bash "$ROOT/scripts/cuda13_from_wheels.sh" "$prefix"
  fi
  # shellcheck disable=SC1091
  source "$prefix/env.sh"
  export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$HOME/.cache/llama_cpp_ex/cargo-target-cuda}"
  [ "${1:-}" = tests ] || rm -rf "$PACK"
  mkdir -p "$PACK"
  # test binaries: their paths from cargo's JSON messages
  cargo test "${manifest[@]}" --release -p llama_cpp_ex_engine --features cuda --no-run \
    --test arch_parity --test tensor_backend --message-format=json |
    python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]:
        print(m["target"]["name"], m["executable"])' | while read -r name exe; do
    xz -T2 -6 -c "$exe" > "$PACK/$name.xz"
  done
  # the kernels NVRTC compiles on a GPU's first use, compiled here (NVRTC is a compiler and
  # needs no GPU; the toolkit's driver stub, under the name the binary asks for, lets the
  # test binary start), and run as C++ on CPU threads against candle's CPU ops
  local stub
  stub=$(mktemp -d)
  ln -s "$CUDA_HOME/lib/stubs/libcuda.so" "$stub/libcuda.so.1"
  LD_LIBRARY_PATH="$CUDA_HOME/lib:$stub" cargo test "${manifest[@]}" --release \
    -p llama_cpp_ex_engine --features cuda --lib model::cuda
  rm -rf "$stub"
  [ "${1:-}" = tests ] && { du -sh "$PACK"/*; return; }
  local ex
  for ex in decode_profile graph_probe pool_probe; do
    cargo build "${manifest[@]}" --release -p llama_cpp_ex_engine --features cuda --example "$ex"
    xz -T2 -6 -c "$CARGO_TARGET_DIR/release/examples/$ex" > "$PACK/$ex.xz"
  done
  pack_models_and_anchor
}

# What both packs carry besides the binaries: the random models' makings and llama.cpp's
# source for the anchor.
pack_models_and_anchor() {
  # the tokenizer of SmolLM2 without its weights, for random models made there
  local models="${LLAMA_CPP_EX_MODELS:-$HOME/.cache/llama_cpp_ex/models}"
  python3 "$ROOT/scripts/tokenizer_only_gguf.py" "$models/SmolLM2-135M-Instruct.Q4_1.gguf" "$PACK/tok.gguf"
  cp "$ROOT/scripts/random_llama.py" "$PACK/"
  # gguf and the pure-Python packages it imports (numpy comes from the machine's Python)
  mkdir -p "$PACK/py"
  for pkg in gguf yaml tqdm; do
    cp -r "$(python3 -c "import $pkg,os; print(os.path.dirname($pkg.__file__))")" "$PACK/py/"
  done
  local src="${LLAMA_CPP_SRC:-$(ls -d /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | tail -1)}"
  [ -f "$src/CMakeLists.txt" ] || { echo "llama.cpp's source not found: set LLAMA_CPP_SRC" >&2; exit 1; }
  tar -C "$src" -cJf "$PACK/lcp.tar.xz" --exclude=build --exclude=.git \
    CMakeLists.txt cmake ggml src include common tools vendor licenses LICENSE
  du -sh "$PACK"/* | sort -h
  echo "packed $(du -sh "$PACK" | cut -f1) in .gpu/: run 'scripts/gpu_check.sh run' (or 'cores' after 'pack cores') there with carry [\".gpu\"]"
}

# CUDA 13 runtime libraries: the machine's toolkit first, then PyTorch's wheels
find_cuda_libs() {
  local py=python3 dirs=() d
  [ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64; do
    dirs+=("$d")
  done
  for s in $($py -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    for d in "$s"/nvidia/cu13/lib "$s"/nvidia/*/lib; do dirs+=("$d"); done
  done
  local libdirs=""
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
    for d in "${dirs[@]}"; do
      if [ -e "$d/$lib" ]; then
        case ":$libdirs:" in *":$d:"*) ;; *) libdirs="${libdirs:+$libdirs:}$d" ;; esac
        break
      fi
    done
  done
  echo "$libdirs"
}

run() {
  # every step is bounded by its own timeout and a failed one must not end the others
  set +e +o pipefail
  : "${OUT:=/tmp/gpu_check_out}"
  mkdir -p "$OUT"
  # logs gather here and travel back as one archive ($OUT returns at most 8 files)
  local log=/tmp/gpu_check_logs bin=/tmp/gpu_check_bin summary="" t0 deadline
  rm -rf "$log" && mkdir -p "$log" "$bin"
  t0=$(date +%s)
  # the CPU comparison only starts while this much of the call's time remains unspent
  deadline=$((t0 + ${GPU_CHECK_BUDGET_S:-420}))
  el() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$log/progress.log"; }
  finish() {
    el "done"
    echo "===== summary"
    printf '%s' "$summary" | tee "$OUT/summary.txt"
    tar -C "$log" -czf "$OUT/logs.tar.gz" .
  }
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader \
    > "$log/gpu.txt" 2>/dev/null || echo none > "$log/gpu.txt"
  summary+="gpu: $(head -1 "$log/gpu.txt"); host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"$'\n'
  summary+="host flags: $(grep -m1 -o -w -E 'avx512_vnni|amx_int8|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"$'\n'
  local build lb=${LLAMA_CPP_BIN:-/tmp/lcp/build/bin}
  # llama.cpp, built in the background meanwhile from the packed source: `run` its CUDA
  # anchor (its CPU backend too) on 12 jobs beside the parity tests, `cores` the CPU
  # backend alone on every core (a few minutes)
  anchor() {
    local jobs=$1 targets=$2
    shift 2
    mkdir -p /tmp/lcp && tar -C /tmp/lcp -xJf "$PACK/lcp.tar.xz"
    (cd /tmp/lcp && cmake -S . -B build "$@" -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
      -DCMAKE_BUILD_TYPE=Release > "$log/lcp_cmake.log" 2>&1 &&
      cmake --build build -j "$jobs" --target $targets > "$log/lcp_build.log" 2>&1) &
    build=$!
  }
  if [ "$MODE" = run ]; then
    local nvcc
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    PATH="$(dirname "$nvcc"):$PATH" anchor 12 "llama-bench llama-quantize llama-batched-bench" \
      -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF
  elif [ "$MODE" = cores ] && [ -z "${LLAMA_CPP_BIN:-}" ]; then
    anchor "$(nproc)" "llama-bench llama-quantize"
  fi
  LD_LIBRARY_PATH="$(find_cuda_libs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
  for b in arch_parity tensor_backend decode_profile graph_probe pool_probe; do
    [ -f "$PACK/$b.xz" ] && xz -dc "$PACK/$b.xz" > "$bin/$b" && chmod +x "$bin/$b"
  done
  local py=python3 gen
  [ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3
  if [ "$MODE" = run ] || [ "$MODE" = cores ]; then
    PYTHONPATH="$PACK/py" $py "$PACK/random_llama.py" "$PACK/tok.gguf" /tmp/l1b.gguf \
      --shape llama3.2-1b > "$log/gen.log" 2>&1 &
    gen=$!
  fi
  # a decode step of candle's ops at 1B shapes, eager and as one CUDA graph
  graph_probe() {
    el "graph probe"
    timeout 120 "$bin/graph_probe" 16 100 > "$log/graph_probe.txt" 2>&1
    summary+="graph_probe (16 layers at 1B shapes) exit $?:"$'\n'
    summary+="$(grep -v -E '^ +[0-9]+: ' "$log/graph_probe.txt" | head -8)"$'\n'
  }
  if [ "$MODE" = probe ]; then
    graph_probe
    finish
    return
  fi
  if [ "$MODE" = cores ]; then
    models
    [ -f /tmp/l1b-q4km.gguf ] && cpu_cores 0
    finish
    return
  fi
  el "parity on the GPU"
  # LLAMA_CPP_EX_CUDA_KERNELS=$2 (empty: candle's ops alone), LLAMA_CPP_EX_CUDA_GRAPHS=$3;
  # sets r and appends to summary
  parity() {
    local t=$1 kernels=$2 graphs=${3:-0} tag=${2:-ops}
    [ "$graphs" = 1 ] && tag+=_graphs
    (LLAMA_CPP_EX_CUDA_KERNELS=$kernels LLAMA_CPP_EX_CUDA_GRAPHS=$graphs \
      LLAMA_CPP_EX_FIXTURES="$ROOT/test/fixtures" \
      LLAMA_CPP_EX_TEST_BACKEND=cuda timeout 150 "$bin/$t" --test-threads 1 --nocapture \
      > "$log/${t}_$tag.log" 2>&1) && r=ok || r="FAILED ($?)"
    summary+="$t on CUDA, kernels ${kernels:-none}, graphs $graphs: $r; $(grep -E '^test result' "$log/${t}_$tag.log" | head -1)"$'\n'
  }
  local k
  for t in arch_parity tensor_backend; do
    # with the engine's kernels (off by default until these pass with them)
    parity "$t" all
    summary+="$(grep -E 'argmax|panicked|FAILED|failures:' "$log/${t}_all.log" | head -30)"$'\n'
    if [ "$r" != ok ]; then
      # which kernel is at fault: each alone, then none
      for k in attention norm glu rope candidates ""; do
        parity "$t" "$k"
      done
    fi
    # and decode steps replayed as CUDA graphs (off by default until this passes)
    parity "$t" all 1
    summary+="$(grep -E 'panicked|FAILED|failures:' "$log/${t}_all_graphs.log" | head -20)"$'\n'
  done
  if [ "$MODE" = parity ]; then
    finish
    return
  fi
  models
  if [ ! -f /tmp/l1b-q4km.gguf ]; then
    finish
    return
  fi
  local m name
  for m in /tmp/l1b-q4km.gguf /tmp/l135-q41.gguf; do
    name=$(basename "$m" .gguf)
    el "GPU bench $name"
    timeout 90 "$lb/llama-bench" -m "$m" -ngl 99 -p 512 -n 128 -r 3 -o md > "$log/lcp_gpu_$name.md" 2>&1
    GPU=1 PP_REPS=3 timeout 90 "$bin/decode_profile" "$m" 1 128 > "$log/ours_gpu_$name.txt" 2>&1
    # decode with the engine's kernels, against candle's ops above
    LLAMA_CPP_EX_CUDA_KERNELS=all GPU=1 TG_ONLY=1 timeout 60 "$bin/decode_profile" "$m" 1 128 \
      2>&1 | grep -E '^tg' | sed 's/^/engine kernels: /' >> "$log/ours_gpu_$name.txt"
    LLAMA_CPP_EX_CUDA_KERNELS=all GPU=1 STREAMS_ONLY=1 PROMPT=128 timeout 60 \
      "$bin/decode_profile" "$m" 1 128 32 2>&1 | grep -E 'streams' |
      sed 's/^/engine kernels: /' >> "$log/ours_gpu_$name.txt"
    # the kernels' steps replayed as CUDA graphs, one stream and 32
    LLAMA_CPP_EX_CUDA_GRAPHS=1 LLAMA_CPP_EX_CUDA_KERNELS=all GPU=1 TG_ONLY=1 timeout 60 \
      "$bin/decode_profile" "$m" 1 128 2>&1 | grep -E '^(tg|graphs)' |
      sed 's/^/engine kernels, graphs: /' >> "$log/ours_gpu_$name.txt"
    LLAMA_CPP_EX_CUDA_GRAPHS=1 LLAMA_CPP_EX_CUDA_KERNELS=all GPU=1 STREAMS_ONLY=1 PROMPT=128 \
      timeout 60 "$bin/decode_profile" "$m" 1 128 32 2>&1 | grep -E 'streams|graphs' |
      sed 's/^/engine kernels, graphs: /' >> "$log/ours_gpu_$name.txt"
    # 32 streams drawing with llama.cpp's default sampler chain: their best candidates
    # picked on the GPU (with graphs, then without), then whole rows to the host
    local k4=attention,norm,glu,rope
    local run g ks how
    for run in "1 all graphs" "0 all candidates" "0 $k4 whole-rows"; do
      read -r g ks how <<< "$run"
      LLAMA_CPP_EX_CUDA_GRAPHS=$g LLAMA_CPP_EX_CUDA_KERNELS=$ks GPU=1 STREAMS_ONLY=1 SAMPLE=1 \
        PROMPT=128 timeout 60 "$bin/decode_profile" "$m" 1 128 32 2>&1 |
        grep -E 'streams|bytes' | sed "s/^/engine kernels, sampled, $how: /" >> "$log/ours_gpu_$name.txt"
    done
    # and with candle's one-launch products (f32 activations, no Q8_1 quantization launch)
    DMMV=1 LLAMA_CPP_EX_CUDA_KERNELS=all GPU=1 TG_ONLY=1 timeout 60 "$bin/decode_profile" "$m" \
      1 128 2>&1 | grep -E '^tg' | sed 's/^/engine kernels, DMMV: /' >> "$log/ours_gpu_$name.txt"
    # 32 sequences decoding together after 128-token prompts: llama.cpp's batched bench
    # (S_TG is its decode tok/s) and ours at the same depth
    timeout 90 "$lb/llama-batched-bench" -m "$m" -ngl 99 -c 16384 -npp 128 -ntg 128 -npl 1,32 \
      > "$log/lcp_batched_$name.txt" 2>&1
    GPU=1 STREAMS_ONLY=1 PROMPT=128 timeout 60 "$bin/decode_profile" "$m" 1 128 32 \
      >> "$log/ours_gpu_$name.txt" 2>&1
    summary+="$name GPU, llama.cpp CUDA -ngl 99:"$'\n'"$(grep -E '^\| .*(pp|tg)' "$log/lcp_gpu_$name.md")"$'\n'
    summary+="$name GPU, llama-batched-bench (PP TG B N_KV T_PP S_PP T_TG S_TG T S):"$'\n'
    summary+="$(grep -E '^\| +128 \|' "$log/lcp_batched_$name.txt")"$'\n'
    summary+="$name GPU, ours:"$'\n'"$(tail -22 "$log/ours_gpu_$name.txt")"$'\n'
  done
  graph_probe
  # one decode step's kernels on the 1B file, timed by Nsight Compute: their count and GPU
  # time against the step's wall time say how launch-bound the step is
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -1)
  if [ -n "$ncu" ]; then
    el "ncu: one decode step"
    NCU_STEP=1 GPU=1 TG_ONLY=1 timeout 120 "$ncu" --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv --page raw --log-file "$log/ncu_step.csv" \
      "$bin/decode_profile" /tmp/l1b-q4km.gguf 1 4 > "$log/ncu_run.txt" 2>&1
    summary+="one 1B decode step under ncu: $(python3 "$ROOT/scripts/ncu_summary.py" "$log/ncu_step.csv" 2>&1)"$'\n'
  else
    summary+="ncu: not found"$'\n'
  fi
  cpu_cores "$deadline"
  finish
}

# The random models at 1B (Q4_K_M) and SmolLM2 135M (Q4_1) shapes, once the generator
# started in the background and llama.cpp's build are done; none when the build failed.
models() {
  el "random models"
  PYTHONPATH="$PACK/py" $py "$PACK/random_llama.py" "$PACK/tok.gguf" /tmp/l135.gguf \
    --shape smollm2-135m >> "$log/gen.log" 2>&1
  wait "$gen"
  [ -n "${build:-}" ] && wait "$build"
  el "llama.cpp build: $(tail -1 "$log/lcp_build.log" 2>/dev/null)"
  if [ ! -x "$lb/llama-quantize" ]; then
    summary+="llama.cpp's build failed: see lcp_build.log"$'\n'
    return
  fi
  "$lb/llama-quantize" /tmp/l1b.gguf /tmp/l1b-q4km.gguf Q4_K_M "$(nproc)" > "$log/quant.log" 2>&1
  "$lb/llama-quantize" /tmp/l135.gguf /tmp/l135-q41.gguf Q4_1 "$(nproc)" >> "$log/quant.log" 2>&1
}

# The host's cores for issue 43's many-core targets: llama.cpp's CPU backend with the GPU
# hidden (so no op is offloaded) against the engine's CPU path, and the share of the read
# ceiling (`CEILING=1`: the probe at the same thread count) per thread count; at the most
# threads, where a decode step's time goes and the AVX2 level. Thread counts start only
# while the clock is before $1 (0: no limit).
cpu_cores() {
  local t m name first=1
  # the pool's own cost a call and how decode-sized products split, per thread count
  el "pool probe"
  timeout 60 "$bin/pool_probe" 4 8 16 > "$log/pool_probe.txt" 2>&1
  summary+="pool probe:"$'\n'"$(grep -v '^threads 1:' "$log/pool_probe.txt")"$'\n'
  for t in ${CORES_THREADS:-16 8 4}; do
    for m in /tmp/l1b-q4km.gguf /tmp/l135-q41.gguf; do
      name=$(basename "$m" .gguf)
      if [ "$1" -gt 0 ] && [ "$(date +%s)" -gt "$1" ]; then
        summary+="CPU $name at $t threads: skipped (time)"$'\n'
        continue
      fi
      el "CPU $name at $t threads"
      CUDA_VISIBLE_DEVICES= timeout 60 "$lb/llama-bench" -m "$m" -ngl 0 -t "$t" -p 512 -n 128 -r 2 -o md \
        > "$log/lcp_cpu_${name}_$t.md" 2>&1
      PP_REPS=2 timeout 60 "$bin/decode_profile" "$m" "$t" 128 > "$log/ours_cpu_${name}_$t.txt" 2>&1
      CEILING=1 timeout 60 "$bin/decode_profile" "$m" "$t" 128 >> "$log/ours_cpu_${name}_$t.txt" 2>&1
      if [ "$first" = 1 ]; then
        SECTIONS=1 PP_REPS=1 timeout 60 "$bin/decode_profile" "$m" "$t" 128 \
          > "$log/ours_cpu_sections_${name}_$t.txt" 2>&1
        LLAMA_CPP_EX_SIMD=avx2 PP_REPS=2 timeout 60 "$bin/decode_profile" "$m" "$t" 128 \
          > "$log/ours_cpu_avx2_${name}_$t.txt" 2>&1
        summary+="CPU $name $t threads, ours at the AVX2 level: $(grep -E '^(pp|tg)' "$log/ours_cpu_avx2_${name}_$t.txt" | tr '\n' ' ')"$'\n'
        summary+="CPU $name $t threads, a decode step's $(grep -E '^pool:' "$log/ours_cpu_sections_${name}_$t.txt")"$'\n'
        # a single row's products on the one-group kernels (the choice on AMD Zen 5) against
        # the 512-bit two-group kernel, alternated twice, to see whether this CPU wants it too
        local k r ab=""
        for r in 1 2; do
          for k in group wide; do
            ab+="$k $(LLAMA_CPP_EX_DECODE_KERNEL=$k TG_ONLY=1 timeout 60 "$bin/decode_profile" "$m" "$t" 128 2>&1 |
              grep -E '^tg' | sed 's/^tg128: //'); "
          done
        done
        summary+="CPU $name $t threads, single-row decode kernel: $ab"$'\n'
      fi
      summary+="CPU $name $t threads: llama.cpp $(grep -E '^\| .*(pp|tg)' "$log/lcp_cpu_${name}_$t.md" |
        awk -F'|' '{printf "%s %s; ", $(NF-2), $(NF-1)}') ours $(grep -E '^(pp|tg|pool|median)' "$log/ours_cpu_${name}_$t.txt" | tr '\n' ' ')"$'\n'
    done
    first=0
  done
}

case "$MODE" in
  pack) pack "${2:-}" ;;
  run | parity | probe | cores) run ;;
  *) echo "usage: $0 pack [tests|cores]|run|parity|probe|cores" >&2; exit 2 ;;
esac
