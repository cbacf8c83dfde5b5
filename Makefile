# kvroute — see README.md. `make run` starts the local demo, `make test` runs every check.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
WASM := target/wasm32-wasip1/release/kvroute.wasm
NATIVE_BINS := target/release/vllm-sim target/release/kvroute-indexer

.PHONY: all
all: build native

# The filter: a size-optimised release kvroute.wasm (installs the target if missing).
.PHONY: build
build:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	cargo build --release --target wasm32-wasip1 -p kvroute
	@ls -l $(WASM)

# Native companions: the simulated vLLM pod and the indexer.
.PHONY: native
native:
	cargo build --release -p vllm-sim -p kvroute-indexer

.PHONY: venv
venv: $(VENV)/.installed
$(VENV)/.installed: integration/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r integration/requirements.txt
	touch $@

# The README's main command: 4 simulated pods behind Envoy with kvroute on 127.0.0.1:10000.
.PHONY: run
run: build native venv
	$(PY) integration/run_local.py

# The same with KV events: pods -> kvroute-indexer (:8090) -> Envoy singleton -> precise routing.
.PHONY: run-precise
run-precise: build native venv
	$(PY) integration/run_local.py --precise

.PHONY: fmt
fmt:
	cargo fmt --all

.PHONY: lint
lint:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --target wasm32-wasip1 -p kvroute -p kvroute-core --all-targets -- -D warnings

.PHONY: unit
unit:
	cargo test --workspace

# End-to-end and config tests with the real Envoy at --concurrency 2.
.PHONY: e2e
e2e: build native venv
	KVROUTE_SIM_BIN=target/release/vllm-sim KVROUTE_INDEXER_BIN=target/release/kvroute-indexer \
	  $(PY) -m pytest tests

.PHONY: test
test: lint unit e2e


# Precise-mode latencies: event-to-routable CDF and the /tokenize call-out's added latency.
.PHONY: bench-latency
bench-latency: build native venv
	KVROUTE_SIM_BIN=target/release/vllm-sim KVROUTE_INDEXER_BIN=target/release/kvroute-indexer \
	  $(PY) integration/latency.py event-to-routable
	KVROUTE_SIM_BIN=target/release/vllm-sim KVROUTE_INDEXER_BIN=target/release/kvroute-indexer \
	  $(PY) integration/latency.py tokenizer

# Component makefiles (simulator, indexer, mesh packaging, benchmark) add their targets here.
-include mk/*.mk
