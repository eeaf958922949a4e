#!/usr/bin/env bash
# End to end, the way a user without Rust installs LlamaCppEx: the release step builds the
# host artifact and lays the package out as Hex ships it (checksum file included); a local
# HTTP server on 127.0.0.1 serves the artifact; a new Mix project depends on the package by
# path and, with no cargo on its PATH, compiles (downloading, verifying and installing the
# NIF) and runs the demo. Then again offline from the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
work="$(mktemp -d)"
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "==> release step: host artifact and package layout"
mix llama_cpp_ex.release --target host --out "$work/artifacts" --package "$work/pkg" >"$work/release.log" 2>&1 ||
  { cat "$work/release.log"; exit 1; }
ls "$work/artifacts"

echo "==> serving the artifacts on 127.0.0.1"
python3 -u -m http.server 0 --bind 127.0.0.1 --directory "$work/artifacts" >"$work/http.log" 2>&1 &
server_pid=$!
port=""
for _ in $(seq 1 100); do
  port="$(sed -n 's/.*port \([0-9]*\).*/\1/p' "$work/http.log" | head -1)"
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "the artifact server did not start"; cat "$work/http.log"; exit 1; }

echo "==> a new project depending on the package, with no cargo on the PATH"
mkdir -p "$work/app/lib"
cat >"$work/app/mix.exs" <<EOF
defmodule App.MixProject do
  use Mix.Project
  def project, do: [app: :app, version: "0.1.0", deps: [{:llama_cpp_ex, path: "$work/pkg"}]]
end
EOF
nocargo_path="$(echo "$PATH" | tr ':' '\n' | grep -v -e cargo -e rustup | paste -sd: -)"
if PATH="$nocargo_path" command -v cargo >/dev/null; then
  echo "cargo is still on the PATH without its own folders; cannot test an install without it"
  exit 1
fi

run_app() {
  (cd "$work/app" && env -u CARGO_TARGET_DIR PATH="$nocargo_path" MIX_ENV=dev \
    LLAMA_CPP_EX_BASE_URL="http://127.0.0.1:$port" LLAMA_CPP_EX_CACHE_DIR="$work/cache" "$@")
}

run_app mix compile 2>&1 | tee "$work/compile.log"
grep -q "installed the precompiled llama_cpp_ex-v" "$work/compile.log"
[ -f "$work/pkg/priv/native/llama_cpp_ex_nif.so" ]
cmp "$work/pkg/priv/native/llama_cpp_ex_nif.so" priv/native/llama_cpp_ex_nif.so
run_app mix run "$work/pkg/scripts/demo.exs" | tee "$work/demo.log"
grep -q "== generate (greedy)" "$work/demo.log"

echo "==> offline: the cache reinstalls it"
kill "$server_pid"
server_pid=""
rm -rf "$work/pkg/priv/native" "$work/app/_build"
run_app mix compile 2>&1 | tee "$work/compile2.log"
grep -q "installed the precompiled" "$work/compile2.log"
run_app mix run -e 'IO.puts(LlamaCppEx.init())' | grep -q '^ok$'

cd "$root"
echo "test_precompiled: a project without cargo installed the precompiled NIF and ran the demo"
