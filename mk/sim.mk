# vllm-sim: simulated vLLM pods (integration/vllm-sim), its Python harness and tests.
SIM_BIN := target/release/vllm-sim

.PHONY: sim sim-tokenizer sim-lint sim-test sim-calibrate
sim:
	cargo build --release -p vllm-sim

# Offline DeepSeek tokenizer.json from the pinned litellm wheel -> build/tokenizers/
sim-tokenizer: venv
	$(PY) -c 'import sys; sys.path.insert(0, "integration"); import simcluster; print(simcluster.ensure_tokenizer())'

sim-lint:
	cargo fmt -p vllm-sim -- --check
	cargo clippy -p vllm-sim --all-targets -- -D warnings

sim-test: sim venv sim-tokenizer
	cargo test -p vllm-sim
	$(PY) -m pytest tests/sim

# Calibration evidence for integration/vllm-sim/README.md (several minutes).
sim-calibrate: sim venv
	$(PY) integration/vllm-sim/tools/calibrate.py all
