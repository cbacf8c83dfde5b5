"""A plugin configuration update (Envoy calls on_configure again, in the same VMs) takes effect
without losing the index: the listener comes from a file (LDS) that the test rewrites."""

import contextlib
import json
import os
import time

import pytest
import requests
import yaml

from e2elib import chat, decision, require_wasm, unique_system
from envoyctl import EnvoyProcess, render_gateway


def split_lds(config_text: str, directory: str) -> tuple[str, dict, str]:
    """Moves the listener into an LDS file; returns (bootstrap text, listener, lds path)."""
    cfg = yaml.safe_load(config_text)
    listener = cfg["static_resources"].pop("listeners")[0]
    lds = os.path.join(directory, "lds.yaml")
    cfg["node"] = {"id": "kvroute-e2e", "cluster": "kvroute-e2e"}  # required by file-based LDS
    cfg["dynamic_resources"] = {"lds_config": {"path_config_source": {"path": lds}, "resource_api_version": "V3"}}
    return yaml.safe_dump(cfg, sort_keys=False), listener, lds


def write_lds(path: str, listener: dict) -> None:
    doc = {"resources": [dict({"@type": "type.googleapis.com/envoy.config.listener.v3.Listener"}, **listener)]}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    os.rename(tmp, path)  # Envoy watches for the move


def plugin_of(listener: dict) -> dict:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["http_filters"][0]["typed_config"]["config"]["configuration"]


def wait_for_header(envoy, header: str) -> None:
    """Until responses carry `header`: the updated configuration is live."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if header in chat(envoy, unique_system(words=5), "probe").headers:
            return
        time.sleep(0.2)
    pytest.fail(f"the update never took effect:\n{envoy.log_tail()}")


@contextlib.contextmanager
def lds_gateway(sims, directory, plugin: dict):
    """The gateway with its listener in an LDS file; yields (envoy, listener, lds path)."""
    require_wasm()
    bootstrap, listener, lds = split_lds(render_gateway(sims.addresses, plugin), str(directory))
    write_lds(lds, listener)
    port = listener["address"]["socket_address"]["port_value"]
    with EnvoyProcess(bootstrap, listener_port=port) as envoy:
        envoy.wait_for_peers()
        yield envoy, listener, lds


def test_config_update_keeps_the_index(sims, tmp_path):
    # The index lives in the singleton and shared data: a filter configuration update leaves it.
    with lds_gateway(sims, tmp_path, {}) as (envoy, listener, lds):
        system = unique_system()
        first = decision(chat(envoy, system, "same question"))
        envoy.wait_for_index_flush()

        configuration = plugin_of(listener)
        updated = json.loads(configuration["value"])
        updated["decision_header"] = "x-kvroute-why"
        updated["weights"] = {"prefill": 1.0, "decode": 2.0}
        configuration["value"] = json.dumps(updated)
        listener["name"] = "llm_gateway"  # same listener, new filter config
        write_lds(lds, listener)

        wait_for_header(envoy, "x-kvroute-why")
        r = chat(envoy, system, "same question")
        raw = r.headers["x-kvroute-why"]
        assert f"pod={first['pod']};" in raw and f"matched={first['total']}/{first['total']}" in raw, raw
        # What a worker routes still reaches the singleton after the update (queues
        # re-registered), and every worker reads what it publishes.
        fresh = unique_system()
        pods = {chat(envoy, fresh, "q0").headers["x-vllm-sim-pod"]}
        envoy.wait_for_index_flush()
        pods |= {chat(envoy, fresh, f"q{i}").headers["x-vllm-sim-pod"] for i in range(1, 10)}
        assert len(pods) == 1, pods
        assert requests.get(envoy.admin_url + "/ready", timeout=5).status_code == 200


def test_new_worker_vms_read_the_index_at_once(sims, tmp_path):
    """A new VM configuration (as a module upgrade would bring) starts new worker VMs with the
    same vm_id: they hold no index, and read the one the singleton keeps publishing in shared
    data from their first request."""
    with lds_gateway(sims, tmp_path, {}) as (envoy, listener, lds):
        system = unique_system()
        first = decision(chat(envoy, system, "same question"))
        envoy.wait_for_index_flush()

        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        vm_config = hcm["http_filters"][0]["typed_config"]["config"]["vm_config"]
        vm_config["configuration"] = {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": "v2"}
        plugin_config = plugin_of(listener)
        updated = json.loads(plugin_config["value"])
        updated["decision_header"] = "x-kvroute-v2"
        plugin_config["value"] = json.dumps(updated)
        write_lds(lds, listener)

        wait_for_header(envoy, "x-kvroute-v2")
        raw = chat(envoy, system, "same question").headers["x-kvroute-v2"]
        assert f"pod={first['pod']};" in raw and f"matched={first['total']}/{first['total']}" in raw, raw
