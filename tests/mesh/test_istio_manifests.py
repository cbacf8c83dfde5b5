"""istio/: every manifest validates (Istio CRD schemas, Kubernetes schemas), every kustomization
builds, and the pieces agree with each other (names, ports, labels, principals, paths)."""

import copy
import json
import re

import pytest
import yaml

import meshlib

OVERLAYS = ["gateway", "sidecar"]
WASM_FILE = "/var/lib/kvroute/plugin.wasm"


def rendered(overlay):
    return meshlib.kustomize_objects(meshlib.ISTIO_DIR / "overlays" / overlay)


def find(objs, kind, name=None):
    out = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert out, f"no {kind} {name or ''}"
    return out


def envoyfilter_patches(objs):
    (ef,) = find(objs, "EnvoyFilter")
    return ef, {p["applyTo"]: p for p in ef["spec"]["configPatches"]}


def filter_config(objs):
    """The filter's PluginConfig of an overlay."""
    _, patches = envoyfilter_patches(objs)
    return patches["HTTP_FILTER"]["patch"]["value"]["typed_config"]["config"]


def wasm_configs(objs):
    """(filter PluginConfig, singleton PluginConfig, bootstrap override) of the gateway overlay
    (sidecars have no singleton: they look prompts up, see test_sidecars_hold_no_index)."""
    (cm,) = find(objs, "ConfigMap", "kvroute-bootstrap")
    boot = json.loads(cm["data"]["custom_bootstrap.json"])
    (ext,) = boot["bootstrap_extensions"]
    return filter_config(objs), ext["typed_config"], boot


def plugin_json(plugin_config):
    return json.loads(plugin_config["configuration"]["value"])


def pod_patch(overlay):
    name = {"gateway": "ingressgateway-pod.yaml", "sidecar": "client-pod.yaml"}[overlay]
    (doc,) = meshlib.load_yaml_docs(meshlib.ISTIO_DIR / "overlays" / overlay / "patches" / name)
    return doc


# ---------------------------------------------------------------------------
# Schemas


def test_there_are_manifests():
    kinds = {d["kind"] for _, d in meshlib.istio_manifests()}
    assert {"EnvoyFilter", "Deployment", "Service", "AuthorizationPolicy", "NetworkPolicy"} <= kinds, kinds


@pytest.mark.parametrize("where,doc", meshlib.istio_manifests(), ids=lambda x: x if isinstance(x, str) else "")
def test_source_manifest_validates(where, doc):
    assert meshlib.manifest_errors(doc) == [], where


@pytest.mark.parametrize("directory", meshlib.kustomization_dirs(), ids=lambda p: str(p.relative_to(meshlib.ROOT)))
def test_kustomization_builds_and_every_object_validates(directory):
    objs = meshlib.kustomize_objects(directory)
    assert objs
    errors = {f"{o['kind']}/{o['metadata']['name']}": meshlib.manifest_errors(o) for o in objs}
    assert {k: v for k, v in errors.items() if v} == {}


def test_every_yaml_under_istio_is_used():
    """Each manifest file is a resource of some kustomization, or a documented patch."""
    used = set()
    for d in meshlib.kustomization_dirs():
        (k,) = meshlib.load_yaml_docs(d / "kustomization.yaml")
        used |= {(d / r).resolve() for r in k.get("resources", [])}
        for gen in k.get("configMapGenerator", []):
            used |= {(d / f.split("=")[-1]).resolve() for f in gen.get("files", [])}
    for path in meshlib.ISTIO_DIR.rglob("*"):
        if path.is_dir() or path.name == "kustomization.yaml" or "patches" in path.parts:
            continue
        assert path.resolve() in used, f"{path} is in no kustomization"


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda ef: ef["spec"]["configPatches"][0].__setitem__("applyTo", "HTTPFILTER"), "HTTPFILTER"),
        (lambda ef: ef["spec"]["configPatches"][0]["match"].__setitem__("contxt", "GATEWAY"), "contxt"),
        (lambda ef: ef["spec"]["configPatches"][0]["patch"].__setitem__("operation", "INSERT"), "INSERT"),
        (lambda ef: ef["spec"].__setitem__("targetRefs", [{"kind": "Gateway", "name": "x"}]), "only one of"),
        (lambda ef: ef["spec"]["workloadSelector"]["labels"].__setitem__("app", "*"), "wildcard"),
    ],
)
def test_validator_refuses_broken_envoyfilter(mutate, needle):
    ef = copy.deepcopy(find(rendered("gateway"), "EnvoyFilter")[0])
    assert meshlib.manifest_errors(ef) == []
    mutate(ef)
    errs = meshlib.manifest_errors(ef)
    assert any(needle in e for e in errs), errs


def test_validator_refuses_broken_core_objects():
    objs = rendered("gateway")
    dep = copy.deepcopy(find(objs, "Deployment", "kvroute-indexer")[0])
    dep["spec"]["replicas"] = "one"
    assert meshlib.manifest_errors(dep)
    dep = copy.deepcopy(find(objs, "Deployment", "kvroute-indexer")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["portz"] = []
    assert meshlib.manifest_errors(dep)
    ap = copy.deepcopy(find(objs, "AuthorizationPolicy", "kvroute-indexer-feed")[0])
    ap["spec"]["rules"][0]["to"][0]["operation"]["path"] = ["/v1/feed"]
    assert meshlib.manifest_errors(ap)


# ---------------------------------------------------------------------------
# The overlays' pieces agree


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_contents(overlay):
    objs = rendered(overlay)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for kind, name in [
        ("Deployment", "kvroute-indexer"),
        ("Service", "kvroute-indexer"),
        ("Service", "vllm-pods"),
        ("ServiceAccount", "kvroute-indexer"),
        ("PeerAuthentication", "kvroute-indexer"),
        ("AuthorizationPolicy", "kvroute-indexer-events"),
        ("AuthorizationPolicy", "kvroute-indexer-feed"),
        ("NetworkPolicy", "kvroute-indexer-events"),
        ("NetworkPolicy", "kvroute-indexer-feed"),
        ("EnvoyFilter", f"kvroute-{overlay}"),
        ("DestinationRule", "vllm-kvroute"),
    ]:
        assert (kind, name) in names, (kind, name)
    # the singleton's bootstrap override: only gateways hold an index fed by the indexer
    assert (("ConfigMap", "kvroute-bootstrap") in names) == (overlay == "gateway")


def test_filter_and_singleton_share_vm_and_module():
    filt, svc, boot = wasm_configs(rendered("gateway"))
    assert svc["singleton"] is True
    sing = svc["config"]
    assert filt["vm_config"]["vm_id"] == sing["vm_config"]["vm_id"] == "kvroute"
    assert filt["vm_config"]["code"] == sing["vm_config"]["code"] == {"local": {"filename": WASM_FILE}}
    assert filt["vm_config"]["runtime"] == sing["vm_config"]["runtime"] == "envoy.wasm.runtime.v8"
    assert filt["allow_on_headers_stop_iteration"] is True
    assert filt["failure_policy"] == "FAIL_OPEN"
    assert plugin_json(filt).get("role", "filter") == "filter"
    assert plugin_json(sing)["role"] == "singleton"
    assert plugin_json(filt)["block_size"] == plugin_json(sing)["block_size"]
    # the override adds the singleton and the allocator's release of freed heap, nothing else
    assert set(boot) == {"bootstrap_extensions", "memory_allocator_manager"}, set(boot)
    assert int(boot["memory_allocator_manager"]["bytes_to_release"]) > 0


def test_sidecars_hold_no_index():
    """Issue 10: a sidecar needs no endpoint list and no feed; it looks prompts up at the
    indexer (remote_index) after getting their token ids from a pod (tokenizer), fail open."""
    filt = filter_config(rendered("sidecar"))
    assert filt["allow_on_headers_stop_iteration"] is True
    assert filt["failure_policy"] == "FAIL_OPEN"
    assert filt["vm_config"]["code"] == {"local": {"filename": WASM_FILE}}
    cfg = plugin_json(filt)
    assert cfg.get("role", "filter") == "filter"
    assert "indexer" not in cfg and not cfg.get("endpoints")
    remote = cfg["remote_index"]
    assert 1 <= remote["timeout_ms"] <= 100, "a short wait: a late answer is decided locally"
    assert remote["min_blocks"] >= 1
    _, patches = envoyfilter_patches(rendered("sidecar"))
    vllm = patches["CLUSTER"]["match"]["cluster"]
    assert cfg["tokenizer"]["cluster"] == f"outbound|{vllm['portNumber']}||{vllm['service']}"
    assert cfg["tokenizer"]["authority"] == f"{vllm['service']}:{vllm['portNumber']}"
    spec, proxy = istio_proxy_patch("sidecar")
    assert "env" not in proxy, "no bootstrap override: no singleton"
    assert [v["name"] for v in spec["volumes"]] == ["kvroute-wasm"]


MERGE_KEYS = {"containers": "name", "volumes": "name", "env": "name", "volumeMounts": "mountPath"}


def strategic_merge(base, patch):
    """kubectl's strategic merge for the lists a pod patch touches (merged by their key)."""
    out = dict(base)
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = strategic_merge(out[k], v)
        elif isinstance(v, list) and k in MERGE_KEYS and isinstance(out.get(k), list):
            key = MERGE_KEYS[k]
            merged = {item[key]: item for item in out[k]}
            for item in v:
                merged[item[key]] = strategic_merge(merged[item[key]], item) if item[key] in merged else item
            out[k] = list(merged.values())
        else:
            out[k] = v
    return out


def istio_proxy_patch(overlay):
    spec = pod_patch(overlay)["spec"]["template"]["spec"]
    (proxy,) = [c for c in spec["containers"] if c["name"] == "istio-proxy"]
    return spec, proxy


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_module_and_bootstrap_mounted_where_the_configs_load_them(overlay):
    spec, proxy = istio_proxy_patch(overlay)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in proxy["volumeMounts"]}
    assert set(volumes) == set(mounts)
    # the module: compat image layer holds plugin.wasm (integration/oci_image.py COMPAT_FILE)
    wasm_mount = mounts["kvroute-wasm"]
    assert wasm_mount["mountPath"].rstrip("/") + "/plugin.wasm" == WASM_FILE and wasm_mount["readOnly"]
    assert volumes["kvroute-wasm"]["image"]["reference"].endswith("-compat")
    # the singleton (gateways): ISTIO_BOOTSTRAP_OVERRIDE names custom_bootstrap.json of the
    # generated ConfigMap
    if overlay == "gateway":
        env = {e["name"]: e.get("value") for e in proxy["env"]}
        (cm,) = find(rendered(overlay), "ConfigMap", "kvroute-bootstrap")
        assert volumes["kvroute-bootstrap"]["configMap"]["name"] == cm["metadata"]["name"]
        assert env["ISTIO_BOOTSTRAP_OVERRIDE"] == mounts["kvroute-bootstrap"]["mountPath"] + "/custom_bootstrap.json"
        assert "custom_bootstrap.json" in cm["data"]
        ef, _ = envoyfilter_patches(rendered(overlay))
        assert cm["metadata"]["namespace"] == ef["metadata"]["namespace"], "ConfigMap beside the patched pods"
    # kvroute's stats are exported by the Istio proxy
    ann = pod_patch(overlay)["spec"]["template"]["metadata"]["annotations"]
    proxy_config = json.loads(ann["proxy.istio.io/config"])
    assert "wasmcustom.kvroute" in proxy_config["proxyStatsMatcher"]["inclusionPrefixes"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_patch_merges_into_a_valid_deployment(overlay):
    """Into a client Deployment (no istio-proxy yet: the injector merges it) and into a gateway
    Deployment that spells istio-proxy out."""
    for containers in ([{"name": "app", "image": "app:1"}],
                       [{"name": "istio-proxy", "image": "auto", "env": [{"name": "A", "value": "1"}],
                         "volumeMounts": [{"name": "workload-socket", "mountPath": "/var/run/secrets/workload-spiffe-uds"}]}]):
        base = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "target", "namespace": "llm"},
            "spec": {
                "selector": {"matchLabels": {"app": "target"}},
                "template": {
                    "metadata": {"labels": {"app": "target"}},
                    "spec": {"containers": containers, "volumes": [{"name": "workload-socket", "emptyDir": {}}]},
                },
            },
        }
        merged = strategic_merge(base, pod_patch(overlay))
        assert meshlib.manifest_errors(merged) == []
        pod = merged["spec"]["template"]["spec"]
        names = [c["name"] for c in pod["containers"]]
        assert names.count("istio-proxy") == 1 and names[0] == containers[0]["name"]
        (proxy,) = [c for c in pod["containers"] if c["name"] == "istio-proxy"]
        ours = {"kvroute-wasm", "kvroute-bootstrap"} if overlay == "gateway" else {"kvroute-wasm"}
        assert {m["name"] for m in proxy["volumeMounts"]} >= ours
        assert {v["name"] for v in pod["volumes"]} >= ours | {"workload-socket"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_envoyfilter_selects_the_patched_proxies(overlay):
    objs = rendered(overlay)
    ef, patches = envoyfilter_patches(objs)
    sel = ef["spec"]["workloadSelector"]["labels"]
    if overlay == "gateway":
        (gw,) = find(objs, "Gateway")
        assert gw["spec"]["selector"] == sel
        assert {p["match"]["context"] for p in patches.values()} == {"GATEWAY"}
        # Istio's ingress gateway serves Gateway port 80 on listener port 8080
        assert gw["spec"]["servers"][0]["port"]["number"] == 80
        assert patches["LISTENER"]["match"]["listener"]["portNumber"] == 8080
    else:
        labels = pod_patch(overlay)["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items()
        assert {p["match"]["context"] for p in patches.values()} == {"SIDECAR_OUTBOUND"}
    assert patches["HTTP_FILTER"]["match"]["listener"]["portNumber"] == patches["LISTENER"]["match"]["listener"]["portNumber"]
    sub = patches["HTTP_FILTER"]["match"]["listener"]["filterChain"]["filter"]
    assert sub == {"name": "envoy.filters.network.http_connection_manager", "subFilter": {"name": "envoy.filters.http.router"}}
    assert patches["HTTP_FILTER"]["patch"]["operation"] == "INSERT_BEFORE"


def vllm_objects():
    return meshlib.kustomize_objects(meshlib.ISTIO_DIR / "vllm")


def vllm_container():
    (dep,) = find(vllm_objects(), "Deployment", "vllm")
    return dep, dep["spec"]["template"]["spec"]["containers"][0]


def expand_k8s_vars(text, env):
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def arg_value(args, flag):
    for a in args:
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {args}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_patch_targets_the_vllm_service(overlay):
    _, patches = envoyfilter_patches(rendered(overlay))
    match = patches["CLUSTER"]["match"]["cluster"]
    (svc,) = find(vllm_objects(), "Service", "vllm")
    assert match["service"] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert match["portNumber"] in [p["port"] for p in svc["spec"]["ports"]]
    value = patches["CLUSTER"]["patch"]["value"]
    (pol,) = value["load_balancing_policy"]["policies"]
    oh = pol["typed_extension_config"]
    assert oh["name"] == "envoy.load_balancing_policies.override_host"
    filt = filter_config(rendered(overlay))
    header = plugin_json(filt).get("destination_header", "x-gateway-destination-endpoint")
    assert oh["typed_config"]["override_host_sources"] == [{"header": header}]
    (fb,) = oh["typed_config"]["fallback_policy"]["policies"]
    assert fb["typed_extension_config"]["name"] == "envoy.load_balancing_policies.least_request"
    # the route buffers the largest body the filter will parse plus one read from the client,
    # so buffering for kvroute never overflows into Envoy's 413; the upstream connection
    # buffer holds the whole body
    max_body = plugin_json(filt).get("max_body_bytes", 4194304)
    read = patches["LISTENER"]["patch"]["value"]["per_connection_buffer_limit_bytes"]
    assert patches["HTTP_ROUTE"]["patch"]["value"]["request_body_buffer_limit"] >= max_body + read
    assert patches["CLUSTER"]["patch"]["value"]["per_connection_buffer_limit_bytes"] >= max_body


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_plugin_configs_name_the_indexer_service(overlay):
    objs = rendered(overlay)
    (svc,) = find(objs, "Service", "kvroute-indexer")
    feed_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http-feed")
    fqdn = f"kvroute-indexer.{svc['metadata']['namespace']}.svc.cluster.local"
    if overlay == "gateway":
        filt, svc_cfg, _ = wasm_configs(objs)
        targets = [plugin_json(filt)["indexer"], plugin_json(svc_cfg["config"])["indexer"]]
    else:
        targets = [plugin_json(filter_config(objs))["remote_index"]]
    for target in targets:
        assert target["cluster"] == f"outbound|{feed_port}||{fqdn}"  # Istio's cluster name
        assert target["authority"] == f"{fqdn}:{feed_port}"


def test_vllm_publishes_to_the_indexer_with_the_topic_convention():
    objs = rendered("gateway")
    dep, c = vllm_container()
    env = {e["name"]: e.get("value", f"<{e['name']}>") for e in c["env"]}
    assert next(e for e in c["env"] if e["name"] == "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    kv = json.loads(expand_k8s_vars(arg_value(c["args"], "--kv-events-config"), {**env, "POD_IP": "10.1.2.3"}))
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    # endpoint without '*': vLLM connects to the indexer's Service, zmq port
    (isvc,) = find(objs, "Service", "kvroute-indexer")
    zmq_port = next(p["port"] for p in isvc["spec"]["ports"] if p["name"] == "tcp-zmq")
    assert kv["endpoint"] == f"tcp://kvroute-indexer.{isvc['metadata']['namespace']}.svc.cluster.local:{zmq_port}"
    assert "*" not in kv["endpoint"]
    # topic kv@<ip:port>@<model>, port = the port kvroute routes to
    port = arg_value(c["args"], "--port")
    assert kv["topic"] == f"kv@10.1.2.3:{port}@{env['MODEL_NAME']}"
    # replay socket binds on the port the headless Service and the indexer use
    replay_port = int(kv["replay_endpoint"].rsplit(":", 1)[1])
    assert kv["replay_endpoint"].startswith("tcp://*:")
    (headless,) = find(objs, "Service", "vllm-pods")
    assert headless["spec"]["clusterIP"] == "None"
    assert replay_port in [p["port"] for p in headless["spec"]["ports"]]
    assert replay_port in [p["containerPort"] for p in c["ports"]]
    (idx,) = find(objs, "Deployment", "kvroute-indexer")
    iargs = idx["spec"]["template"]["spec"]["containers"][0]["args"]
    assert int(arg_value(iargs, "--replay-port")) == replay_port
    assert arg_value(iargs, "--dns-service") == \
        f"vllm-pods.{headless['metadata']['namespace']}.svc.cluster.local:{port},speed=1"
    assert arg_value(iargs, "--model") == env["MODEL_NAME"]
    (isvc_feed,) = [p for p in isvc["spec"]["ports"] if p["name"] == "http-feed"]
    assert arg_value(iargs, "--listen") == f"0.0.0.0:{isvc_feed['port']}"
    assert arg_value(iargs, "--zmq-bind") == f"tcp://*:{zmq_port}"
    # block size: vLLM == indexer == filter
    filt = filter_config(objs)
    assert arg_value(c["args"], "--block-size") == arg_value(iargs, "--block-size") == str(plugin_json(filt)["block_size"])
    # the headless Service selects vLLM pods, as the vllm Service does
    (vsvc,) = find(vllm_objects(), "Service", "vllm")
    assert vsvc["spec"]["selector"].items() <= headless["spec"]["selector"].items()
    assert headless["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_each_vllm_pool_is_discovered_at_the_speed_its_label_names():
    """Pods of two speeds (issue 15.1): every vLLM Deployment's pods are selected by the vllm
    Service and by exactly one headless Service, which the indexer resolves with the speed of
    the pods' kvroute.io/speed label."""
    objs = rendered("gateway")
    (idx,) = find(objs, "Deployment", "kvroute-indexer")
    iargs = idx["spec"]["template"]["spec"]["containers"][0]["args"]
    speed_of_service = {}
    for arg in iargs:
        if arg.startswith("--dns-service="):
            host, _, speed = arg.split("=", 1)[1].partition(",speed=")
            speed_of_service[host.split(".", 1)[0]] = float(speed)
    headless = {s["metadata"]["name"]: s for s in find(objs, "Service") if s["spec"].get("clusterIP") == "None"}
    assert set(speed_of_service) == set(headless), (speed_of_service, headless.keys())
    (vsvc,) = find(vllm_objects(), "Service", "vllm")
    speeds = set()
    for dep in find(vllm_objects(), "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert vsvc["spec"]["selector"].items() <= labels.items(), dep["metadata"]["name"]
        selecting = [n for n, s in headless.items() if s["spec"]["selector"].items() <= labels.items()]
        assert len(selecting) == 1, (dep["metadata"]["name"], selecting)
        assert speed_of_service[selecting[0]] == float(labels["kvroute.io/speed"])
        speeds.add(labels["kvroute.io/speed"])
    assert speeds == {"1", "0.5"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lockdown_only_vllm_publishes_only_proxies_read(overlay):
    objs = rendered(overlay)
    (idx,) = find(objs, "Deployment", "kvroute-indexer")
    idx_labels = idx["spec"]["template"]["metadata"]["labels"]
    ns = idx["metadata"]["namespace"]
    dep, c = vllm_container()
    vllm_sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    ports = {p["name"]: p["containerPort"] for p in idx["spec"]["template"]["spec"]["containers"][0]["ports"]}

    (pa,) = find(objs, "PeerAuthentication", "kvroute-indexer")
    assert pa["spec"]["mtls"]["mode"] == "STRICT"
    assert pa["spec"]["selector"]["matchLabels"].items() <= idx_labels.items()

    rules = []
    for ap in find(objs, "AuthorizationPolicy"):
        assert ap["metadata"]["namespace"] == ns
        assert ap["spec"]["action"] == "ALLOW"
        assert ap["spec"]["selector"]["matchLabels"].items() <= idx_labels.items()
        rules += ap["spec"]["rules"]
    # who may reach the zmq port: exactly the vLLM service account
    zmq = [r for r in rules if any(str(ports["tcp-zmq"]) in t["operation"].get("ports", []) for t in r["to"])]
    assert [s["source"] for r in zmq for s in r["from"]] == [{"principals": [f"cluster.local/ns/{ns}/sa/{vllm_sa}"]}]
    # who may read the index (gateways: the feed; sidecars: lookups): the proxies' principals only
    read = "/v1/feed" if overlay == "gateway" else "/v1/lookup"
    feed = [r for r in rules if any(read in t["operation"].get("paths", []) for t in r["to"])]
    principals = [p for r in feed for s in r["from"] for p in s["source"]["principals"]]
    if overlay == "gateway":
        assert principals == ["cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account"]
    else:
        sa = pod_patch(overlay)["spec"]["template"]["spec"]["serviceAccountName"]
        ef, _ = envoyfilter_patches(objs)
        assert principals == [f"cluster.local/ns/{ef['metadata']['namespace']}/sa/{sa}"]
    for r in feed:
        assert all(set(s["source"]) == {"principals"} for s in r["from"])
    # nothing else may write: POST only on /v1/learned (and the read-only /v1/lookup)
    for r in rules:
        for t in r["to"]:
            op = t["operation"]
            assert "methods" in op or op.get("ports") == [str(ports["tcp-zmq"])], op
            if "POST" in op.get("methods", []):
                assert op["paths"] in (["/v1/learned"], ["/v1/lookup"])

    # NetworkPolicy: L4 equivalent
    nps = find(objs, "NetworkPolicy")
    for np in nps:
        assert np["spec"]["podSelector"]["matchLabels"].items() <= idx_labels.items()
        assert np["spec"]["policyTypes"] == ["Ingress"]
    ingress = [rule for np in nps for rule in np["spec"]["ingress"]]
    zmq_from = [rule["from"] for rule in ingress if {"protocol": "TCP", "port": ports["tcp-zmq"]} in rule.get("ports", [])]
    assert zmq_from == [[{"podSelector": {"matchLabels": {"app": "vllm"}}}]]
    assert {"app": "vllm"}.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    feed_from = [rule["from"] for rule in ingress if {"protocol": "TCP", "port": ports["http-feed"]} in rule.get("ports", [])]
    assert len(feed_from) == 2  # proxies, and the monitoring namespace for /metrics
    for rule in ingress:
        assert "from" in rule or all(p["port"] in (15020, 15021) for p in rule["ports"]), rule


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_reads_and_the_learned_write_are_apart(overlay):
    """Issue 13: a learned entry steers every proxy. The write (POST /v1/learned) is granted by a
    policy of its own to the gateway's identity alone; no rule mixes it with a read; sidecars may
    only read (any client could otherwise steer everyone) and do not report; the indexer requires
    the token that only the gateway pod gets (Secret -> env -> singleton VM)."""
    objs = rendered(overlay)
    proxy_read = {"gateway": ("/v1/feed", "GET"), "sidecar": ("/v1/lookup", "POST")}[overlay]
    reads = {proxy_read[0]: proxy_read[1], "/healthz": "GET", "/metrics": "GET", "/v1/debug/*": "GET"}
    writers, readers = [], {}
    for ap in find(objs, "AuthorizationPolicy"):
        for rule in ap["spec"]["rules"]:
            ops = [t["operation"] for t in rule["to"]]
            paths = {p for op in ops for p in op.get("paths", [])}
            if "/v1/learned" in paths:
                assert paths == {"/v1/learned"} and all(op["methods"] == ["POST"] for op in ops), ap
                assert ap["metadata"]["name"] == "kvroute-indexer-learned"
                writers += [s["source"] for s in rule["from"]]
            for path in paths & set(reads):
                assert all(op["methods"] == [reads[path]] for op in ops if path in op.get("paths", [])), ap
                readers.setdefault(path, []).extend(s["source"] for s in rule["from"])
    assert set(readers) == set(reads)
    filt = filter_config(objs)
    (idx,) = find(objs, "Deployment", "kvroute-indexer")
    pod = idx["spec"]["template"]["spec"]
    token_file = arg_value(pod["containers"][0]["args"], "--learned-token-file")
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if token_file.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]["secretName"]
    assert token_file == f"{mount['mountPath']}/token" and mount["readOnly"]
    if overlay == "gateway":
        _, singleton, _ = wasm_configs(objs)
        indexer_cfg = plugin_json(singleton["config"])["indexer"]
        assert writers == [{"principals": ["cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account"]}]
        assert readers["/v1/feed"] == writers
        assert indexer_cfg.get("share_learned", True) is True
        variable = indexer_cfg["token_env"]
        assert variable in singleton["config"]["vm_config"]["environment_variables"]["host_env_keys"]
        _, proxy = istio_proxy_patch(overlay)
        (env,) = [e for e in proxy["env"] if e["name"] == variable]
        assert env["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "token"}
        # the filters never hold the token either
        assert "token_env" not in plugin_json(filt)["indexer"]
    else:
        # sidecars hold no index, so they have nothing to report (no singleton, no indexer feed)
        assert writers == []
        assert "indexer" not in plugin_json(filt)
        _, proxy = istio_proxy_patch(overlay)
        assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in proxy.get("env", []))


def test_plugin_configs_in_istio_are_valid():
    found = [(w, c) for w, c in meshlib.example_plugin_configs() if w.startswith("istio/")]
    roles = sorted(c.get("role", "filter") for _, c in found)
    assert roles == ["filter", "filter", "singleton"], found  # the sidecars have no singleton
    for where, cfg in found:
        assert meshlib.plugin_config_errors(cfg) == [], where


def indexer_flags():
    """Long flags of kvroute-indexer, from its clap definition (indexer/src/config.rs)."""
    path = meshlib.ROOT / "indexer" / "src" / "config.rs"
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8")
    flags = set()
    for attr, field in re.findall(r"#\[arg\(([^\]]*)\)\]\s*(?:///[^\n]*\s*)*pub (\w+):", text):
        m = re.search(r'long\s*=\s*"([^"]+)"', attr)
        if m:
            flags.add(m.group(1))
        elif re.search(r"\blong\b", attr):
            flags.add(field.replace("_", "-"))
    return flags


def test_indexer_deployment_uses_existing_flags():
    flags = indexer_flags()
    if flags is None:
        pytest.skip("indexer/src/config.rs not in this tree")
    assert {"listen", "zmq-bind", "block-size"} <= flags, flags
    (idx,) = find(rendered("gateway"), "Deployment", "kvroute-indexer")
    for arg in idx["spec"]["template"]["spec"]["containers"][0]["args"]:
        name = arg.split("=", 1)[0]
        assert name.startswith("--") and name[2:] in flags, f"kvroute-indexer has no flag {name}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_destination_rule_keeps_the_cluster_acceptable(overlay):
    """The vLLM host's DestinationRule turns locality load balancing off, so Istio adds no
    locality-weighted common_lb_config, which Envoy refuses with load_balancing_policy
    (tests/mesh/test_envoy_configs.py::test_destination_rule_fields_with_override_host)."""
    objs = rendered(overlay)
    _, patches = envoyfilter_patches(objs)
    drs = [d for d in find(objs, "DestinationRule") if d["spec"]["host"] == patches["CLUSTER"]["match"]["cluster"]["service"]]
    assert len(drs) == 1, "exactly one DestinationRule for the vLLM host"
    lb = drs[0]["spec"]["trafficPolicy"]["loadBalancer"]
    assert lb["localityLbSetting"] == {"enabled": False}
    assert "consistentHash" not in lb
    assert lb["simple"] == "LEAST_REQUEST"
    bad = copy.deepcopy(drs[0])
    bad["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"] = {"httpHeaderName": "x"}
    assert meshlib.manifest_errors(bad), "simple and consistentHash are exclusive"
