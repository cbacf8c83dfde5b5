# kvroute-indexer (indexer/; its vLLM KV-event codec is indexer/src/vllm_wire.rs), the feed codec (core/src/feed.rs),
# the fuzz targets of every decoder and parser (fuzz/) and end-to-end tests (tests/indexer).
INDEXER_BIN := target/release/kvroute-indexer
FUZZ_SECONDS ?= 60
# FUZZ_RUNS=N runs each target N executions instead of FUZZ_SECONDS (the README's figures: 10M).
FUZZ_RUNS ?=
FUZZ_LIMIT = $(if $(FUZZ_RUNS),-runs=$(FUZZ_RUNS),-max_total_time=$(FUZZ_SECONDS))
FUZZ_ALL := events_decode feed_decode request_parse peer_wire lookup_decode header_map index_published config_parse metrics_scrape events_apply
# FUZZ_TARGETS="events_decode" runs only those (every corpus is still seeded).
FUZZ_TARGETS ?= $(FUZZ_ALL)
GOLDEN_FRAMES := testdata/vllm-golden/frames

.PHONY: indexer indexer-lint indexer-test indexer-bench fuzz fuzz-build
indexer: ## release binary target/release/kvroute-indexer
	cargo build --release -p kvroute-indexer

indexer-lint: ## rustfmt + clippy (-D warnings) of kvroute-indexer and kvroute-core
	cargo fmt -p kvroute-indexer -p kvroute-core -- --check
	cargo clippy -p kvroute-indexer -p kvroute-core --all-targets -- -D warnings

indexer-test: indexer venv ## cargo tests (codec goldens, feed codec, index) + pytest tests/indexer
	cargo test -p kvroute-core --lib -- feed::
	cargo test -p kvroute-indexer
	KVROUTE_INDEXER_BIN=$(INDEXER_BIN) $(PY) -m pytest tests/indexer

indexer-bench: ## events/s, memory per (block, pod), feed sizes (numbers in indexer/README.md)
	cargo bench -p kvroute-indexer --bench indexer

# cargo-fuzz is installed from crates.io when missing; libFuzzer needs nightly
# features, enabled on the stable toolchain with RUSTC_BOOTSTRAP=1.
fuzz-build: ## build every fuzz target (installs cargo-fuzz if missing)
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz build

fuzz: fuzz-build ## cargo fuzz every target for FUZZ_SECONDS (or FUZZ_RUNS executions), seeded with the golden captures
	mkdir -p $(addprefix fuzz/corpus/,$(FUZZ_ALL))
	cp $(GOLDEN_FRAMES)/*.payload.msgpack fuzz/corpus/events_decode/
	cp fuzz/seeds/feed_decode/* fuzz/corpus/feed_decode/
	cp fuzz/seeds/request_parse/* fuzz/corpus/request_parse/
	cp fuzz/seeds/lookup_decode/* fuzz/corpus/lookup_decode/
	cp fuzz/seeds/config_parse/* fuzz/corpus/config_parse/
	cp fuzz/seeds/metrics_scrape/* fuzz/corpus/metrics_scrape/
	cp fuzz/seeds/events_apply/* fuzz/corpus/events_apply/
	set -e; for t in $(FUZZ_TARGETS); do \
	  (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run $$t corpus/$$t -- $(FUZZ_LIMIT) -rss_limit_mb=2048); \
	done
