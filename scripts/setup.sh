#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build and test LlamaCppEx (Elixir, Erlang
# headers, a Rust toolchain check, curl, the `openai` Python client) and fetches the test
# models from PyPI into the cache.
# Idempotent: does nothing that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

need_apt=()
command -v mix >/dev/null 2>&1 || need_apt+=(elixir)
command -v erl >/dev/null 2>&1 || need_apt+=(erlang-nox)
[ -n "$(ls /usr/lib/erlang/usr/include/erl_nif.h 2>/dev/null)" ] || need_apt+=(erlang-dev)
command -v make >/dev/null 2>&1 || need_apt+=(make)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "==> apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is required (https://rustup.rs); no Rust toolchain found" >&2
  exit 1
fi

# the official OpenAI client drives the HTTP server in test/http_server_test.exs
if ! python3 -c "import openai" >/dev/null 2>&1; then
  echo "==> pip install openai"
  python3 -m pip install -q openai
fi

echo "==> models"
python3 scripts/fetch_models.py
