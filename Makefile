# Builds the Rust NIF in release mode and installs it under priv/native.
#   LLAMA_BACKEND=cpu|cuda   cargo features (cpu, the default; cuda adds the GPU backend, built
#                            with the CUDA 13 toolkit of scripts/cuda13_from_wheels.sh in
#                            ~/.cache/llama_cpp_ex/cuda13 unless CUDA_ROOT names another)
#   CARGO_TARGET_DIR         cargo's build directory (default native/target)
#   LLAMA_NATIVE_CPU=1       compile for this machine's CPU (-C target-cpu=native); off by
#                            default so a build runs on any x86-64 and picks kernels at run time

CARGO ?= cargo
LLAMA_BACKEND ?= cpu
CARGO_TARGET_DIR ?= $(CURDIR)/native/target
PRIV_DIR := $(CURDIR)/priv/native

ifeq ($(LLAMA_BACKEND),cuda)
  FEATURES := --features cuda
  # the toolkit scripts/cuda13_from_wheels.sh made, unless one is set up already
  CUDA_ENV := $(if $(CUDA_ROOT),,$(wildcard $(HOME)/.cache/llama_cpp_ex/cuda13/env.sh))
else ifeq ($(LLAMA_BACKEND),cpu)
  FEATURES :=
else
  $(error LLAMA_BACKEND must be cpu or cuda, got $(LLAMA_BACKEND))
endif

ifeq ($(LLAMA_NATIVE_CPU),1)
  export RUSTFLAGS := $(RUSTFLAGS) -C target-cpu=native
endif

ifeq ($(shell uname -s),Darwin)
  LIB_EXT := dylib
else
  LIB_EXT := so
endif

.PHONY: native clean test models setup demo
# The NIF, and the helper that renders chat templates in a process of its own.
native:
	@$(if $(CUDA_ENV),. $(CUDA_ENV) && )CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) $(CARGO) build --release --quiet \
	  --manifest-path native/Cargo.toml -p llama_cpp_ex_nif $(FEATURES)
	@CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) $(CARGO) build --release --quiet \
	  --manifest-path native/Cargo.toml -p llama_cpp_ex_engine --bin llama_cpp_ex_render
	@mkdir -p $(PRIV_DIR)
	@cp -f $(CARGO_TARGET_DIR)/release/libllama_cpp_ex_nif.$(LIB_EXT) $(PRIV_DIR)/llama_cpp_ex_nif.so.tmp
	@mv -f $(PRIV_DIR)/llama_cpp_ex_nif.so.tmp $(PRIV_DIR)/llama_cpp_ex_nif.so
	@cp -f $(CARGO_TARGET_DIR)/release/llama_cpp_ex_render $(PRIV_DIR)/llama_cpp_ex_render.tmp
	@mv -f $(PRIV_DIR)/llama_cpp_ex_render.tmp $(PRIV_DIR)/llama_cpp_ex_render

models:
	python3 scripts/fetch_models.py

setup:
	scripts/setup.sh

demo: setup
	mix run scripts/demo.exs

test: setup
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) scripts/check_style.sh
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) $(CARGO) test --release --manifest-path native/Cargo.toml -p llama_cpp_ex_engine
	LLAMA_CPP_EX_TEST_BACKEND=tensor CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) $(CARGO) test --release \
	  --manifest-path native/Cargo.toml -p llama_cpp_ex_engine --test arch_parity --test tensor_backend
	LLAMA_CPP_EX_CUDA_KERNELS=all LLAMA_CPP_EX_TEST_BACKEND=tensor CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) \
	  $(CARGO) test --release --manifest-path native/Cargo.toml -p llama_cpp_ex_engine \
	  --test arch_parity --test tensor_backend
	LLAMA_CPP_EX_CUDA_GRAPHS=1 LLAMA_CPP_EX_CUDA_KERNELS=all LLAMA_CPP_EX_TEST_BACKEND=tensor \
	  CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) $(CARGO) test --release \
	  --manifest-path native/Cargo.toml -p llama_cpp_ex_engine --test arch_parity --test tensor_backend
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) scripts/test_simd_levels.sh
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) scripts/check_aarch64.sh
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) scripts/test_precompiled.sh
	mix test

clean:
	rm -rf $(PRIV_DIR)
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) $(CARGO) clean --manifest-path native/Cargo.toml
