# Mesh packaging: OCI image of the wasm module, Istio/Envoy manifest checks.
# `make oci` writes build/oci/kvroute-wasm/ (OCI image layout, tags VERSION and VERSION-compat)
# and build/oci/kvroute-wasm-VERSION.oci.tar, verified after writing.

OCI_OUT ?= build/oci
OCI_VERSION ?=
OVERLAY ?= gateway

.PHONY: oci
oci: venv ## OCI image of kvroute.wasm for Istio under OCI_OUT (build/oci)
	@test -f $(WASM) || $(MAKE) build
	$(PY) integration/oci_image.py --wasm $(WASM) --out $(OCI_OUT) $(if $(OCI_VERSION),--version $(OCI_VERSION))

.PHONY: test-mesh
test-mesh: venv ## the tests/mesh suite: schemas, CRDs, kustomize, envoy --mode validate, docs
	$(PY) -m pytest -q tests/mesh

.PHONY: istio-render
istio-render: ## print the rendered manifests of OVERLAY=gateway|sidecar (kubectl kustomize)
	kubectl kustomize istio/overlays/$(OVERLAY)

MESH_LOOKUP_OUT ?= build/mesh-lookup
.PHONY: mesh-lookup
mesh-lookup: venv indexer ## gateway (full index) vs 4 sidecars (remote lookup): pod prefix-cache hit rate, Envoy RSS, bytes from the indexer (quick profile shape; MESH_LOOKUP_OUT)
	@test -f $(WASM) || $(MAKE) build
	KVROUTE_INDEXER_BIN=$(INDEXER_BIN) $(PY) integration/mesh_lookup.py --out $(MESH_LOOKUP_OUT)
