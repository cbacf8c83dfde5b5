# Mesh packaging: OCI image of the wasm module, Istio/Envoy manifest checks (issue 6).
# `make oci`        -> build/oci/kvroute-wasm/ (OCI image layout, tags VERSION and VERSION-compat)
#                      and build/oci/kvroute-wasm-VERSION.oci.tar, verified after writing.
# `make test-mesh`  -> the tests/mesh suite (schemas, CRDs, kustomize, envoy --mode validate, e2e).
# `make istio-render OVERLAY=gateway|sidecar` -> print the rendered manifests of an overlay.

OCI_OUT ?= build/oci
OCI_VERSION ?=
OVERLAY ?= gateway

.PHONY: oci
oci: venv
	@test -f $(WASM) || $(MAKE) build
	$(PY) integration/oci_image.py --wasm $(WASM) --out $(OCI_OUT) $(if $(OCI_VERSION),--version $(OCI_VERSION))

.PHONY: test-mesh
test-mesh: venv
	$(PY) -m pytest -q tests/mesh

.PHONY: istio-render
istio-render:
	kubectl kustomize istio/overlays/$(OVERLAY)
