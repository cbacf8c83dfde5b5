# kvroute-indexer (indexer/; its vLLM KV-event codec is indexer/src/vllm_wire.rs), the feed codec (core/src/feed.rs),
# the fuzz targets of every decoder and parser (fuzz/) and end-to-end tests (tests/indexer).
#   make indexer        release binary target/release/kvroute-indexer
#   make indexer-lint   rustfmt + clippy (-D warnings) of kvroute-indexer and kvroute-core
#   make indexer-test   cargo tests (decoder goldens, codec, index) + pytest tests/indexer
#   make indexer-bench  events/s, memory per (block, pod), feed sizes (numbers in indexer/README.md)
#   make fuzz           cargo fuzz, FUZZ_SECONDS per target (stable toolchain: RUSTC_BOOTSTRAP=1)
INDEXER_BIN := target/release/kvroute-indexer
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := events_decode feed_decode request_parse peer_wire
GOLDEN_FRAMES := testdata/vllm-golden/frames

.PHONY: indexer indexer-lint indexer-test indexer-bench fuzz fuzz-build
indexer:
	cargo build --release -p kvroute-indexer

indexer-lint:
	cargo fmt -p kvroute-indexer -p kvroute-core -- --check
	cargo clippy -p kvroute-indexer -p kvroute-core --all-targets -- -D warnings

indexer-test: indexer venv
	cargo test -p kvroute-core --lib -- feed::
	cargo test -p kvroute-indexer
	KVROUTE_INDEXER_BIN=$(INDEXER_BIN) $(PY) -m pytest tests/indexer

indexer-bench:
	cargo bench -p kvroute-indexer --bench indexer

# cargo-fuzz is installed from crates.io when missing; libFuzzer needs nightly
# features, enabled on the stable toolchain with RUSTC_BOOTSTRAP=1.
fuzz-build:
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz build

fuzz: fuzz-build
	mkdir -p $(addprefix fuzz/corpus/,$(FUZZ_TARGETS))
	cp $(GOLDEN_FRAMES)/*.payload.msgpack fuzz/corpus/events_decode/
	cp fuzz/seeds/feed_decode/* fuzz/corpus/feed_decode/
	cp fuzz/seeds/request_parse/* fuzz/corpus/request_parse/
	set -e; for t in $(FUZZ_TARGETS); do \
	  (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run $$t corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048); \
	done
