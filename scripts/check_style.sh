#!/usr/bin/env bash
# Fails on unformatted Elixir or Rust, and on clippy warnings for the host target (every
# target: the crates, their tests, examples and binaries, x86 intrinsics included), before
# the long test suites run.
set -euo pipefail
cd "$(dirname "$0")/.."
mix format --check-formatted
cargo fmt --manifest-path native/Cargo.toml --all -- --check
cargo clippy --release --quiet --manifest-path native/Cargo.toml --workspace --all-targets \
  -- -D warnings
echo "check_style: formatted, clippy clean"
