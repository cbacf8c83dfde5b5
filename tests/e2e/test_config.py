"""Plugin configuration is checked when Envoy loads it: a bad one is refused, naming the field."""

import pytest

from e2elib import require_wasm
from envoyctl import render_gateway, validate


@pytest.fixture(autouse=True)
def wasm_built():
    require_wasm()


def test_gateway_config_validates():
    result = validate(render_gateway(["127.0.0.1:18001", "127.0.0.1:18002"]))
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("plugin, field", [
    ({"weights": {"prefill": -1}}, "weights.prefill"),
    ({"wieghts": {}}, "wieghts"),
    ({"block_size": 0}, "block_size"),
    ({"endpoints": [{"address": "no-port"}]}, "endpoints[0].address"),
    ({"indexer": {"cluster": ""}}, "indexer.cluster"),
])
def test_bad_plugin_config_is_refused_naming_the_field(plugin, field):
    result = validate(render_gateway(["127.0.0.1:18001"], plugin))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"field `{field}`" in output, output[-3000:]
