"""envoy/mesh-{gateway,sidecar}.yaml are what the Istio overlays produce.

Take the plain-Envoy reproduction, remove every kvroute part (what Istio generates on its own is
left), apply the overlay's EnvoyFilter patches and bootstrap override with Istio's semantics
(MERGE = protobuf merge: messages merged field by field, repeated fields appended, scalars
replaced; INSERT_BEFORE = insert before the matched HTTP filter), and compare with the file.
The module path differs by design (/var/lib/kvroute/plugin.wasm in the pod, the build output
here) and is the only thing normalised.
"""

import copy
import json

import pytest
import yaml

import meshlib

ISTIO_WASM = "/var/lib/kvroute/plugin.wasm"
LOCAL_WASM = "target/wasm32-wasip1/release/kvroute.wasm"
HCM = "envoy.filters.network.http_connection_manager"


def proto_merge(dst, src):
    """Istio MERGE / bootstrap override: protobuf merge semantics on the JSON form."""
    if isinstance(dst, dict) and isinstance(src, dict):
        if "@type" in dst and "@type" in src and dst["@type"] != src["@type"]:
            return copy.deepcopy(src)
        out = dict(dst)
        for k, v in src.items():
            out[k] = proto_merge(dst[k], v) if k in dst else copy.deepcopy(v)
        return out
    if isinstance(dst, list) and isinstance(src, list):
        return dst + copy.deepcopy(src)
    return copy.deepcopy(src)


def listener_port(listener):
    # Istio names listeners <bind>_<port>; the reproduction keeps those names.
    return int(listener["name"].rsplit("_", 1)[1])


def hcm_of(listener):
    for chain in listener["filter_chains"]:
        for f in chain["filters"]:
            if f["name"] == HCM:
                return f["typed_config"]
    return None


def apply_envoyfilter(config, envoyfilter):
    cfg = copy.deepcopy(config)
    res = cfg["static_resources"]
    applied = {}
    for p in envoyfilter["spec"]["configPatches"]:
        kind, match, patch = p["applyTo"], p["match"], p["patch"]
        n = 0
        if kind in ("LISTENER", "HTTP_FILTER"):
            for i, listener in enumerate(res["listeners"]):
                if listener_port(listener) != match["listener"]["portNumber"]:
                    continue
                if kind == "LISTENER":
                    assert patch["operation"] == "MERGE"
                    res["listeners"][i] = proto_merge(listener, patch["value"])
                    n += 1
                    continue
                fc = match["listener"]["filterChain"]["filter"]
                assert fc["name"] == HCM
                hcm = hcm_of(listener)
                names = [f["name"] for f in hcm["http_filters"]]
                target = fc["subFilter"]["name"]
                assert patch["operation"] == "INSERT_BEFORE"
                hcm["http_filters"].insert(names.index(target), copy.deepcopy(patch["value"]))
                n += 1
        elif kind == "HTTP_ROUTE":
            rc = match["routeConfiguration"]
            for listener in res["listeners"]:
                if listener_port(listener) != rc["portNumber"]:
                    continue
                for vhost in hcm_of(listener)["route_config"]["virtual_hosts"]:
                    if "name" in rc["vhost"] and vhost["name"] != rc["vhost"]["name"]:
                        continue
                    for i, route in enumerate(vhost["routes"]):
                        if route.get("name") == rc["vhost"]["route"]["name"]:
                            assert patch["operation"] == "MERGE"
                            vhost["routes"][i] = proto_merge(route, patch["value"])
                            n += 1
        elif kind == "CLUSTER":
            want = f"outbound|{match['cluster']['portNumber']}||{match['cluster']['service']}"
            for i, cluster in enumerate(res["clusters"]):
                if cluster["name"] == want:
                    assert patch["operation"] == "MERGE"
                    res["clusters"][i] = proto_merge(cluster, patch["value"])
                    n += 1
        else:
            raise AssertionError(f"patch kind {kind} not modelled by this test")
        applied[kind] = applied.get(kind, 0) + n
    return cfg, applied


def strip_kvroute(config):
    """The reproduction without anything kvroute adds: what Istio alone generates."""
    cfg = copy.deepcopy(config)
    cfg.pop("bootstrap_extensions", None)
    cfg.pop("memory_allocator_manager", None)
    for listener in cfg["static_resources"]["listeners"]:
        listener.pop("per_connection_buffer_limit_bytes", None)
        hcm = hcm_of(listener)
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "kvroute"]
        for vhost in hcm["route_config"]["virtual_hosts"]:
            for route in vhost["routes"]:
                route.pop("request_body_buffer_limit", None)
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"].startswith("outbound|8000||vllm."):
            cluster.pop("load_balancing_policy", None)
            cluster.pop("per_connection_buffer_limit_bytes", None)
    return cfg


def parse_plugin_json(obj):
    """Compare plugin configurations as JSON values, not as text (YAML block vs JSON string)."""
    if isinstance(obj, dict):
        out = {k: parse_plugin_json(v) for k, v in obj.items()}
        if out.get("@type") == meshlib.STRING_VALUE_TYPE:
            out["value"] = json.loads(out["value"])
        return out
    if isinstance(obj, list):
        return [parse_plugin_json(v) for v in obj]
    return obj


def normalise_module(obj):
    return parse_plugin_json(json.loads(json.dumps(obj).replace(ISTIO_WASM, LOCAL_WASM)))


@pytest.mark.parametrize("overlay", ["gateway", "sidecar"])
def test_reproduction_equals_patched_istio_config(overlay):
    mesh = meshlib.load_yaml_docs(meshlib.ENVOY_DIR / f"mesh-{overlay}.yaml")[0]
    objs = meshlib.kustomize_objects(meshlib.ISTIO_DIR / "overlays" / overlay)
    (ef,) = [o for o in objs if o["kind"] == "EnvoyFilter"]
    # the singleton's bootstrap override: gateways only (sidecars hold no index)
    boots = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kvroute-bootstrap"]
    assert len(boots) == (overlay == "gateway")

    base = strip_kvroute(mesh)
    assert base != mesh
    patched, applied = apply_envoyfilter(base, ef)
    # every patch matched exactly one object of the reproduction
    assert applied == {"HTTP_FILTER": 1, "LISTENER": 1, "HTTP_ROUTE": 1, "CLUSTER": 1}, applied
    for cm in boots:
        patched = proto_merge(patched, json.loads(cm["data"]["custom_bootstrap.json"]))
    assert normalise_module(patched) == parse_plugin_json(mesh)


def test_strip_and_patch_are_not_vacuous():
    """A drift between the overlay and the reproduction is caught."""
    mesh = meshlib.load_yaml_docs(meshlib.ENVOY_DIR / "mesh-gateway.yaml")[0]
    objs = meshlib.kustomize_objects(meshlib.ISTIO_DIR / "overlays" / "gateway")
    (ef,) = [o for o in objs if o["kind"] == "EnvoyFilter"]
    ef = copy.deepcopy(ef)
    cfg = ef["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]
    plugin = json.loads(cfg["configuration"]["value"])
    plugin["weights"]["queue"] = 3.0
    cfg["configuration"]["value"] = json.dumps(plugin)
    patched, _ = apply_envoyfilter(strip_kvroute(mesh), ef)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    patched = proto_merge(patched, json.loads(cm["data"]["custom_bootstrap.json"]))
    assert normalise_module(patched) != parse_plugin_json(mesh)


def test_proto_merge_semantics():
    assert proto_merge({"a": 1, "l": [1], "m": {"x": 1}}, {"a": 2, "l": [2], "m": {"y": 2}}) == {
        "a": 2,
        "l": [1, 2],
        "m": {"x": 1, "y": 2},
    }
