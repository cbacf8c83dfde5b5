"""Helpers shared by the mesh tests: find example configs, validate manifests.

Loaded by tests/mesh/conftest.py (which puts this folder on sys.path).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
ISTIO_CRDS = Path(__file__).resolve().parent / "istio-crds"
ISTIO_DIR = ROOT / "istio"
ENVOY_DIR = ROOT / "envoy"
EXTRA_SCHEMAS = Path(__file__).resolve().parent / "istio-extra-schemas.yaml"
SCHEMA_PATH = ROOT / "schema" / "plugin-config.schema.json"
WASM_PATH = ROOT / "target" / "wasm32-wasip1" / "release" / "kvroute.wasm"
ENVOY_BIN = ROOT / ".venv" / "bin" / "envoy"

WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
WASM_SERVICE_TYPE = "type.googleapis.com/envoy.extensions.wasm.v3.WasmService"
STRING_VALUE_TYPE = "type.googleapis.com/google.protobuf.StringValue"

# Kubernetes version whose schemas the non-Istio manifests are checked against.
K8S_VERSION = "1.33"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_module() -> None:
    """Skip outside CI when kvroute.wasm is not built; in CI (`make test` builds it first) fail."""
    import pytest

    if WASM_PATH.exists():
        return
    if in_ci():
        pytest.fail(f"{WASM_PATH} missing in CI: `make build` must run before the tests")
    pytest.skip(f"{WASM_PATH} not built (run `make build`); CI runs this test")


def load_yaml_docs(path: Path) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def istio_yaml_files() -> list[Path]:
    return sorted(p for p in ISTIO_DIR.rglob("*.yaml") if p.is_file())


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in ISTIO_DIR.rglob("kustomization.yaml"))


def is_kustomize_file(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") in ("Kustomization", "Component")


def istio_manifests() -> list[tuple[str, dict]]:
    """Every Kubernetes object in the files under istio/ (not kustomize files, not patches)."""
    out = []
    for path in istio_yaml_files():
        rel = path.relative_to(ROOT)
        if "patches" in path.parts:
            continue
        for i, doc in enumerate(load_yaml_docs(path)):
            if is_kustomize_file(doc):
                continue
            out.append((f"{rel}#{i}", doc))
    return out


@functools.lru_cache(maxsize=None)
def kustomize_build(directory: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl (with its built-in kustomize) is needed to build istio/ overlays")
    res = subprocess.run([kubectl, "kustomize", directory], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{res.stderr}")
    return res.stdout


def kustomize_objects(directory: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(kustomize_build(str(directory))) if d is not None]


# ---------------------------------------------------------------------------
# Plugin configs found in example configs


def _json_of_configuration(value: Any) -> Any:
    """The plugin configuration JSON carried by an Envoy PluginConfig.configuration."""
    if isinstance(value, dict) and value.get("@type") == STRING_VALUE_TYPE:
        return json.loads(value["value"])
    if isinstance(value, dict) and "@type" not in value and "value" in value:
        return json.loads(value["value"])
    if isinstance(value, str):
        return json.loads(value)
    raise ValueError(f"unsupported configuration encoding: {value!r:.200}")


def plugin_configs_in(obj: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """Yield (location, config) for every kvroute plugin configuration inside obj.

    Recognises Envoy wasm PluginConfig objects (a dict with vm_config and configuration),
    WasmPlugin specs (pluginConfig), and JSON documents embedded in ConfigMaps.
    """
    if isinstance(obj, dict):
        if "vm_config" in obj and "configuration" in obj:
            yield where, _json_of_configuration(obj["configuration"])
        if obj.get("kind") == "WasmPlugin" and "pluginConfig" in obj.get("spec", {}):
            yield where + ".spec.pluginConfig", obj["spec"]["pluginConfig"]
            return
        if obj.get("kind") == "ConfigMap":
            for key, text in (obj.get("data") or {}).items():
                if key.endswith(".json"):
                    yield from plugin_configs_in(json.loads(text), f"{where}.data[{key}]")
            return
        for k, v in obj.items():
            yield from plugin_configs_in(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from plugin_configs_in(v, f"{where}[{i}]")


def example_plugin_configs() -> list[tuple[str, Any]]:
    """Every plugin config in istio/ and envoy/ (the examples the schema must accept)."""
    found = []
    for path in istio_yaml_files() + sorted(ENVOY_DIR.glob("*.yaml")):
        rel = str(path.relative_to(ROOT))
        for i, doc in enumerate(load_yaml_docs(path)):
            found.extend(plugin_configs_in(doc, f"{rel}#{i}"))
    for path in sorted(ISTIO_DIR.rglob("*.json")):
        with open(path, encoding="utf-8") as f:
            found.extend(plugin_configs_in(json.load(f), str(path.relative_to(ROOT))))
    return found


@functools.lru_cache(maxsize=None)
def plugin_config_schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return json.load(f)


def plugin_config_errors(config: Any) -> list[str]:
    v = jsonschema.Draft202012Validator(plugin_config_schema())
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(config))


# ---------------------------------------------------------------------------
# Istio CRD validation


def _closed(schema: Any) -> Any:
    """Make a structural CRD schema strict: unknown fields are errors (kubectl --validate=strict)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def istio_crds() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict openAPIV3Schema, from the vendored Istio CRDs."""
    crds = {}
    for path in sorted(ISTIO_CRDS.glob("*.crd.yaml")):
        for crd in load_yaml_docs(path):
            group = crd["spec"]["group"]
            kind = crd["spec"]["names"]["kind"]
            for ver in crd["spec"]["versions"]:
                schema = copy.deepcopy(ver["schema"]["openAPIV3Schema"])
                schema.setdefault("properties", {})
                schema["properties"]["apiVersion"] = {"const": f"{group}/{ver['name']}"}
                schema["properties"]["kind"] = {"const": kind}
                schema["properties"]["metadata"] = {"type": "object"}
                schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
                crds[(f"{group}/{ver['name']}", kind)] = _closed(schema)
    extra = load_yaml_docs(EXTRA_SCHEMAS)[0]
    for item in extra["kinds"]:
        key = (item["apiVersion"], item["kind"])
        assert key not in crds, f"{key} is now in the shared CRDs: drop it from {EXTRA_SCHEMAS.name}"
        schema = copy.deepcopy(item["schema"])
        schema["properties"].update(
            {"apiVersion": {"const": item["apiVersion"]}, "kind": {"const": item["kind"]}, "metadata": {"type": "object"}}
        )
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
        schema["$defs"] = extra["defs"]
        crds[key] = _closed(schema)
    return crds


def _label_map_ok(m: dict) -> bool:
    return all("*" not in k and k != "" and "*" not in v for k, v in m.items())


def _url_scheme_ok(url: str) -> bool:
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", url)
    return (m.group(1).lower() if m else "") in ("", "http", "https", "oci", "file")


# CEL rules (x-kubernetes-validations) of the Istio CRDs, evaluated here in Python. A rule that
# is not in this table fails validation, so a new rule in the CRDs cannot be silently skipped.
CEL_RULES = {
    '!self.contains("*")': lambda s: "*" not in s,
    'self.all(key, !key.contains("*"))': lambda m: all("*" not in k for k in m),
    "self.all(key, key.size() != 0)": lambda m: all(k != "" for k in m),
    "self.size() == 0": lambda s: len(s) == 0,
    "0 < self && self <= 65535": lambda n: 0 < n <= 65535,
    '(has(self.valueFrom) ? self.valueFrom : "") != "HOST" || !has(self.value)': (
        lambda e: e.get("valueFrom", "") != "HOST" or "value" not in e
    ),
    "(has(self.selector) ? 1 : 0) + (has(self.targetRef) ? 1 : 0) + (has(self.targetRefs) ? 1 : 0) <= 1": (
        lambda s: sum(k in s for k in ("selector", "targetRef", "targetRefs")) <= 1
    ),
    "(has(self.workloadSelector) ? 1 : 0) + (has(self.targetRefs) ? 1 : 0) <= 1": (
        lambda s: sum(k in s for k in ("workloadSelector", "targetRefs")) <= 1
    ),
    'has(self.context) ? ((self.context == "WAYPOINT") ? has(self.waypoint) : !has(self.waypoint)) : !has(self.waypoint)': (
        lambda m: ("waypoint" in m) if m.get("context") == "WAYPOINT" else ("waypoint" not in m)
    ),
}


def _norm_rule(rule: str) -> str:
    return " ".join(rule.split())


_CEL_NORM = {_norm_rule(k): v for k, v in CEL_RULES.items()}


def _url_rule(rule: str) -> bool:
    return "url(self).getScheme()" in rule


def cel_errors(schema: Any, value: Any, path: str = "") -> list[str]:
    """Evaluate x-kubernetes-validations of schema against value, recursively."""
    errs: list[str] = []
    if not isinstance(schema, dict):
        return errs
    for v in schema.get("x-kubernetes-validations", []):
        rule = v["rule"]
        if _url_rule(rule):
            ok = _url_scheme_ok(value)
        else:
            fn = _CEL_NORM.get(_norm_rule(rule))
            if fn is None:
                errs.append(f"{path}: CEL rule not understood by the test, add it to CEL_RULES: {rule}")
                continue
            ok = fn(value)
        if not ok:
            errs.append(f"{path}: {v.get('message', rule)}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for k, sub in value.items():
            if k in props:
                errs.extend(cel_errors(props[k], sub, f"{path}.{k}"))
            elif isinstance(schema.get("additionalProperties"), dict):
                errs.extend(cel_errors(schema["additionalProperties"], sub, f"{path}.{k}"))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            errs.extend(cel_errors(schema["items"], sub, f"{path}[{i}]"))
    return errs


ISTIO_GROUPS = ("networking.istio.io", "security.istio.io", "extensions.istio.io", "telemetry.istio.io")


def is_istio_object(doc: dict) -> bool:
    return doc.get("apiVersion", "").split("/")[0] in ISTIO_GROUPS


def istio_object_errors(doc: dict) -> list[str]:
    key = (doc.get("apiVersion"), doc.get("kind"))
    crds = istio_crds()
    if key not in crds:
        return [f"no CRD schema for {key} in {ISTIO_CRDS}"]
    schema = crds[key]
    v = jsonschema.Draft7Validator(schema)
    errs = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]
    errs += cel_errors(schema, doc)
    errs += metadata_errors(doc)
    return sorted(errs)


_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def metadata_errors(doc: dict) -> list[str]:
    md = doc.get("metadata") or {}
    errs = []
    name = md.get("name")
    if not isinstance(name, str) or not _DNS1123_SUBDOMAIN.match(name) or len(name) > 253:
        errs.append(f"metadata.name {name!r} is not a DNS-1123 subdomain")
    ns = md.get("namespace")
    if ns is not None and not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", ns):
        errs.append(f"metadata.namespace {ns!r} is not a DNS-1123 label")
    return errs


def k8s_object_errors(doc: dict) -> list[str]:
    """Validate a core Kubernetes object against the strict schemas shipped by kubernetes-validate."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return metadata_errors(doc)


def manifest_errors(doc: dict) -> list[str]:
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (apiVersion and kind required)"]
    if is_istio_object(doc):
        return istio_object_errors(doc)
    return k8s_object_errors(doc)
