"""schema/plugin-config.schema.json: matches the plugin configuration reference (the table in
README.md, which docs/contracts.md points to), accepts every example, refuses mistakes."""

import json
import re

import jsonschema
import pytest

import meshlib

REFERENCE = meshlib.ROOT / "README.md"


def contract_table() -> dict[str, str]:
    """field -> default text, from the 'Plugin configuration' table of README.md."""
    text = REFERENCE.read_text(encoding="utf-8")
    section = text.split("## Plugin configuration", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\|\s*`([^`]+)`(?:\s*/\s*`([^`]+)`)?\s*\|\s*(.*?)\s*\|", line)
        if not m:
            continue
        default = m.group(3)
        if m.group(2):  # `tier_discount.cpu` / `.disk` | `0.5` / `0.25`
            d1, d2 = [d.strip() for d in default.split("/")]
            base = m.group(1).rsplit(".", 1)[0]
            rows[m.group(1)] = d1
            rows[base + m.group(2)] = d2
        else:
            rows[m.group(1)] = default
    return rows


def schema_node(path: str) -> dict:
    node = meshlib.plugin_config_schema()
    for part in path.split("."):
        node = node["properties"][part]
    return node


def test_contract_table_parsed():
    rows = contract_table()
    assert len(rows) >= 20, rows
    assert "weights.prefill" in rows and "tier_discount.disk" in rows


@pytest.mark.parametrize("field", sorted(contract_table()))
def test_every_contract_field_is_in_schema_with_its_default(field):
    node = schema_node(field)
    default_text = contract_table()[field].strip("`")
    assert "default" in node, f"{field} has no default in the schema"
    expected = json.loads(default_text)
    assert node["default"] == expected, f"{field}: schema default {node['default']!r} != contract {expected!r}"


def test_schema_has_no_field_missing_from_contract():
    rows = set(contract_table())
    top = meshlib.plugin_config_schema()["properties"]
    for name, node in top.items():
        if name in rows:
            continue
        # objects documented field by field (weights.*, index.*, tier_discount.*)
        subs = {f"{name}.{k}" for k in node.get("properties", {})}
        assert subs and subs <= rows, f"schema field {name} is not in the README table"


def test_schema_is_valid_draft_2020_12():
    jsonschema.Draft202012Validator.check_schema(meshlib.plugin_config_schema())


def test_defaults_form_a_valid_config():
    schema = meshlib.plugin_config_schema()
    cfg = {}
    for name, node in schema["properties"].items():
        if "default" in node:
            cfg[name] = node["default"]
        else:
            cfg[name] = {k: v["default"] for k, v in node["properties"].items()}
    assert meshlib.plugin_config_errors(cfg) == []
    assert meshlib.plugin_config_errors({}) == []


def test_examples_exist():
    found = meshlib.example_plugin_configs()
    where = {w.split("#")[0] for w, _ in found}
    assert any(w.startswith("istio/") for w in where), where
    assert any(w.startswith("envoy/") for w in where), where
    roles = {c.get("role", "filter") for _, c in found}
    assert roles == {"filter", "singleton"}, roles


@pytest.mark.parametrize("where,config", meshlib.example_plugin_configs(), ids=lambda x: x if isinstance(x, str) else "")
def test_example_config_is_valid(where, config):
    assert meshlib.plugin_config_errors(config) == [], where


FULL = {
    "role": "filter",
    "paths": ["/v1/chat/completions"],
    "max_body_bytes": 8388608,
    "block_size": 16,
    "chunk_bytes": 64,
    "max_blocks": 4096,
    "destination_header": "x-gateway-destination-endpoint",
    "fallback_endpoints": 2,
    "decision_header": "",
    "weights": {"prefill": 1.0, "decode": 1.0, "queue": 2.0, "kv_usage": 0.5},
    "tier_discount": {"cpu": 0.5, "disk": 0.25},
    "index": {"ttl_seconds": 600, "flush_ms": 100},
    "default_capacity_blocks": 16384,
    "endpoints": [{"address": "10.0.0.7:8000", "capacity_blocks": 19208, "models": ["qwen"]}, {"address": "[fd00::1]:8000"}],
    "adapters": {"sql-lora": "Qwen/Qwen3-32B"},
    "indexer": {"cluster": "kvroute_indexer", "authority": "kvroute-indexer:8080", "poll_ms": 100},
    "tokenizer": None,
}


def test_full_config_valid():
    assert meshlib.plugin_config_errors(FULL) == []


BAD = [
    ({"weigths": {"prefill": 1}}, "weigths"),
    ({"weights": {"prefil": 1}}, "prefil"),
    ({"weights": {"prefill": -1}}, "prefill"),
    ({"weights": {"queue": "2"}}, "queue"),
    ({"role": "sidecar"}, "role"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": 16.5}, "block_size"),
    ({"max_body_bytes": "4MiB"}, "max_body_bytes"),
    ({"tier_discount": {"cpu": 1.5}}, "cpu"),
    ({"endpoints": [{"address": "10.0.0.7"}]}, "address"),
    ({"endpoints": [{"address": "10.0.0.7:8000", "capacity": 5}]}, "capacity"),
    ({"endpoints": [{"capacity_blocks": 5}]}, "address"),
    ({"indexer": {"cluster": "x", "authority": "y", "poll": 5}}, "poll"),
    ({"indexer": {"authority": "y"}}, "cluster"),
    ({"indexer": {"cluster": "x", "poll_ms": 5}}, "poll_ms"),
    ({"index": {"flush_ms": 5}}, "flush_ms"),
    ({"index": {"flush_ms": 5000}}, "flush_ms"),
    ({"block_size": 2048}, "block_size"),
    ({"paths": []}, "paths"),
    ({"adapters": {"my-lora": 3}}, "my-lora"),
    ({"indexer": {"cluster": "x", "authority": "y", "feed_path": "v1/feed"}}, "feed_path"),
    ({"tokenizer": {"cluster": "x", "authority": "y", "timeout_ms": 0}}, "timeout_ms"),
    ({"paths": ["v1/completions"]}, "paths"),
    ({"destination_header": "X Dest"}, "destination_header"),
    ({"index": {"ttl": 5}}, "ttl"),
]


@pytest.mark.parametrize("config,needle", BAD, ids=[n for _, n in BAD])
def test_mistakes_are_refused(config, needle):
    errs = meshlib.plugin_config_errors(config)
    assert errs, f"accepted {config}"
    assert any(needle in e for e in errs), errs
