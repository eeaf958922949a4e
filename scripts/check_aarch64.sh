#!/usr/bin/env bash
# Type-checks the native crates (every target, tests included) for aarch64 Linux with clippy
# -D warnings: no own intrinsics may leak outside cfg(target_arch = "x86_64"), and the code
# paths aarch64 takes (candle's NEON quantized kernels, scalar attention) must compile clean.
# Nothing runs there (no aarch64 machine here); skipped with a note when the rustup target
# cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  if ! timeout 300 rustup target add "$target" >/dev/null 2>&1; then
    echo "check_aarch64: SKIPPED (rustup cannot install $target here)"
    exit 0
  fi
fi
base="${CARGO_TARGET_DIR:-native/target}"
CARGO_TARGET_DIR="$base/cross" cargo clippy --release --quiet --target "$target" \
  --manifest-path native/Cargo.toml --all-targets -- -D warnings
echo "check_aarch64: native crates type-check clean for $target"
