# vllm-sim: simulated vLLM pods (integration/vllm-sim), its Python harness and tests.
SIM_BIN := target/release/vllm-sim

.PHONY: sim sim-tokenizer sim-lint sim-test sim-calibrate
sim: ## release binary target/release/vllm-sim
	cargo build --release -p vllm-sim

sim-tokenizer: venv ## offline DeepSeek tokenizer.json from the pinned litellm wheel -> build/tokenizers/
	$(PY) -c 'import sys; sys.path.insert(0, "integration"); import simcluster; print(simcluster.ensure_tokenizer())'

sim-lint: ## rustfmt + clippy (-D warnings) of vllm-sim
	cargo fmt -p vllm-sim -- --check
	cargo clippy -p vllm-sim --all-targets -- -D warnings

sim-test: sim venv sim-tokenizer ## cargo tests of vllm-sim + pytest tests/sim
	cargo test -p vllm-sim
	$(PY) -m pytest tests/sim

sim-calibrate: sim venv ## calibration evidence for integration/vllm-sim/README.md (several minutes)
	$(PY) integration/vllm-sim/tools/calibrate.py all
