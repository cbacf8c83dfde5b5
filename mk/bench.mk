# Benchmark: routing quality and router cost. See integration/bench/README.md and
# docs/benchmark-method.md. BENCH_ARGS passes extra arguments to run.py (e.g. --strategies envoy-random,kvroute-precise,
# --set load.stages='[[6,20]]', --results-dir docs/results/<name>).

BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
# Python 3.12 (inference-perf needs >= 3.12): pyenv's on these machines, else python3.12 on PATH.
PY312 ?= $(firstword $(wildcard /root/.pyenv/versions/3.12.*/bin/python3.12) $(shell command -v python3.12 2>/dev/null))
BENCH_ARGS ?=
OVERHEAD_ARGS ?=

.PHONY: bench-venv bench-prereqs bench bench-full bench-full-scaled bench-overhead bench-report
bench-venv: $(BENCH_VENV)/.installed ## .venv-bench (Python 3.12): inference-perf, the peer routers, Envoy
$(BENCH_VENV)/.installed: integration/bench/requirements.txt integration/bench/constraints.txt
	@test -n "$(PY312)" || { echo "Python 3.12 not found (pyenv install 3.12 or set PY312=...)"; exit 1; }
	$(PY312) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --disable-pip-version-check -r integration/bench/requirements.txt -c integration/bench/constraints.txt
	touch $@

bench-prereqs: bench-venv build native ## everything a benchmark needs: .venv-bench, kvroute.wasm, vllm-sim, kvroute-indexer

bench: bench-prereqs ## quick profile: 9 strategies on 4 vllm-sim pods (~20 min on 2 cores)
	$(BENCH_PY) integration/bench/run.py --profile quick $(BENCH_ARGS)

bench-full: bench-prereqs ## the llm-d 73-capacity replica in real time (8 pods, 16 stages; 5-6 hours)
	$(BENCH_PY) integration/bench/run.py --profile full $(BENCH_ARGS)

BENCH_TIME_SCALE ?= 0.25
bench-full-scaled: bench-prereqs ## the same at sim.time_scale BENCH_TIME_SCALE (0.25: ~3 hours)
	$(BENCH_PY) integration/bench/run.py --profile full --set sim.time_scale=$(BENCH_TIME_SCALE) $(BENCH_ARGS)

bench-overhead: bench-prereqs wrk ## router cost: kvroute vs the same Envoy, and the peers' HTTP hop (wrk)
	$(BENCH_PY) integration/bench/overhead.py $(OVERHEAD_ARGS)

bench-report: bench-venv ## re-render report.md and plot.png of a run: RUN=build/bench/<run>
	$(BENCH_PY) integration/bench/report.py $(RUN)

.PHONY: bench-selftest
bench-selftest: bench-venv ## the harness's own checks (parsers, seeded arrivals, configs, report): seconds
	$(BENCH_PY) integration/bench/selftest.py

# The wasm build of request_phases: cargo names it after a hash, the newest is this build's.
PHASES_WASM = $$(ls -t target/wasm32-wasip1/release/deps/request_phases-*.wasm | head -1)
.PHONY: bench-phases-wasm
bench-phases-wasm: ## a routed request's phases (parse, hash, lookup) as the filter's wasm, in V8 through Node's WASI
	@command -v node >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs; }
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	cargo bench -p kvroute-core --bench request_phases --target wasm32-wasip1 --no-run
	node --no-warnings integration/bench/wasi-run.mjs $(PHASES_WASM) --bench

SCALE_ARGS ?=
.PHONY: bench-scale
bench-scale: venv build native wrk ## fleet scale (issue 10): Envoy RSS, decision_us, CPU/request, feed bytes on 8-5,000 stub pods (~14 min; SCALE_ARGS=--quick: ~2)
	$(PY) integration/bench/scale.py $(SCALE_ARGS)
