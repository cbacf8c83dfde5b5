# kvroute — see README.md. `make run` starts the local demo, `make test` runs every check.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
WASM := target/wasm32-wasip1/release/kvroute.wasm

.PHONY: venv
venv: $(VENV)/.installed
$(VENV)/.installed: integration/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r integration/requirements.txt
	touch $@

# Component makefiles (simulator, indexer, mesh packaging, benchmark) add their targets here.
-include mk/*.mk
