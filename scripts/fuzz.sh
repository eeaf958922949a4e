#!/usr/bin/env bash
# Runs the fuzz targets of native/fuzz (cargo-fuzz, libFuzzer, AddressSanitizer).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     each target for SECONDS (default 60)
#   FUZZ_RUNS=1000000 scripts/fuzz.sh 1800    stop at a million executions or 30 minutes
#
# Targets: gguf tokenizer gbnf json_schema chat_template sampler (default: all).
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`), and the models of
# scripts/fetch_models.py (the tokenizer, grammar and sampler targets use their vocabularies).
# The corpus grows in native/fuzz/corpus/<target> (seeded from native/fuzz/seeds/<target>);
# a crashing input is written to native/fuzz/artifacts/<target>/ and the script fails.
# Logs: native/fuzz/logs/<target>.log; the last lines of each are printed with the executions.
set -euo pipefail
cd "$(dirname "$0")/../native/fuzz"

secs="${1:-60}"
[ $# -gt 0 ] && shift
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(gguf tokenizer gbnf json_schema chat_template sampler)

runs=()
[ -n "${FUZZ_RUNS:-}" ] && runs=("-runs=${FUZZ_RUNS}")

cargo +nightly fuzz build --release "${targets[@]/#/}" >/dev/null 2>&1 || cargo +nightly fuzz build --release
mkdir -p logs
status=0
for t in "${targets[@]}"; do
  case "$t" in
    gguf) max_len=131072 ;;
    *) max_len=16384 ;;
  esac
  mkdir -p "corpus/$t" "artifacts/$t"
  start=$(date +%s)
  if cargo +nightly fuzz run --release "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$secs" "${runs[@]}" -max_len="$max_len" -rss_limit_mb=4096 \
      -timeout=30 -print_final_stats=1 >"logs/$t.log" 2>&1; then
    result=ok
  else
    result=FAILED
    status=1
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "logs/$t.log" | grep -o '[0-9]*$' || echo "?")
  printf '%-14s %-6s %10s executions in %5ss\n' "$t" "$result" "$execs" "$(( $(date +%s) - start ))"
  if [ "$result" = FAILED ]; then
    tail -n 40 "logs/$t.log"
  fi
done
exit $status
