"""The documentation: docs/operator-guide.md and docs/grafana-dashboard.json consistent with each
other, the repo and the filter's own metric definitions; no file pointing outside the repository;
every relative Markdown link alive; `make help` listing every make target."""

import json
import os
import re
import subprocess

import pytest

import meshlib

GUIDE = meshlib.ROOT / "docs" / "operator-guide.md"
DASHBOARD = meshlib.ROOT / "docs" / "grafana-dashboard.json"


def guide_text():
    return GUIDE.read_text(encoding="utf-8")


def guide_metrics() -> dict[str, str]:
    """name -> type, from the one metrics table of the guide."""
    text = guide_text()
    table = text.split("<!-- metrics:begin", 1)[1].split("<!-- metrics:end -->", 1)[0]
    out = {}
    for line in table.splitlines():
        m = re.match(r"^\|\s*`(kvroute_[a-z0-9_]+)`\s*\|\s*(counter|gauge|histogram)\s*\|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def singleton_metrics() -> set[str]:
    """Metrics the guide's table says the singleton exports (proxies without one have none)."""
    table = guide_text().split("<!-- metrics:begin", 1)[1].split("<!-- metrics:end -->", 1)[0]
    return set(re.findall(r"^\|\s*`(kvroute_[a-z0-9_]+)`\s*\|\s*\w+\s*\|\s*singleton\s*\|", table, re.M))


def dashboard():
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def dashboard_exprs():
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_guide_lists_metrics():
    metrics = guide_metrics()
    assert len(metrics) >= 20
    assert "kvroute_requests" in metrics and "kvroute_feed_errors" in metrics
    assert {"kvroute_feed_errors", "kvroute_index_blocks"} <= singleton_metrics()
    assert "kvroute_requests" not in singleton_metrics()


def test_dashboard_structure():
    d = dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for dx in range(g["w"]):
            for dy in range(g["h"]):
                cell = (g["x"] + dx, g["y"] + dy)
                assert cell not in cells, f"panel {p['title']} overlaps another"
                cells.add(cell)
        if p["type"] != "row":
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
                assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
    names = {v["name"] for v in d["templating"]["list"]}
    used = set(re.findall(r"\$([a-z_]+)", " ".join(dashboard_exprs()))) - {"__rate_interval"}
    assert used <= names, used - names


GRAFANA_VARS = {"__rate_interval": "1m", "namespace": ".*", "proxy": ".*", "vllm_namespace": "llm",
                "vllm_service": "vllm.llm.svc.cluster.local"}


def substitute(expr):
    return re.sub(r"\$\{?([a-zA-Z_]+)\}?", lambda m: GRAFANA_VARS[m.group(1)], expr)


def test_dashboard_promql_parses():
    import promql_parser

    exprs = dashboard_exprs()
    assert exprs
    for expr in exprs:
        promql_parser.parse(substitute(expr))  # raises ValueError on a syntax error
    with pytest.raises(ValueError):
        promql_parser.parse(substitute(exprs[0]) + ")")


def test_guide_alert_expressions_parse():
    import promql_parser

    section = guide_text().split("Alerts worth having:", 1)[1].split("\n\n", 1)[0]
    alerts = re.findall(r"`([^`]*\(.*?)`", section)
    assert alerts
    for expr in alerts:
        promql_parser.parse(expr)


def test_dashboard_uses_only_documented_kvroute_metrics():
    documented = guide_metrics()
    exprs = " ".join(dashboard_exprs())
    regexes = re.findall(r'__name__=~"([^"]+)"', exprs)
    plain = re.sub(r'__name__=~"[^"]+"', "", exprs)
    used = set()
    for name in re.findall(r"\bkvroute_[a-z0-9_]+", plain):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if base not in documented and name.endswith(("_bucket", "_sum", "_count")):
            pytest.fail(f"{name}: histogram series of an undocumented metric")
        used.add(base if base in documented else name)
    assert used <= set(documented), used - set(documented)
    for name, kind in documented.items():
        if kind == "histogram":
            assert name not in re.findall(r"\bkvroute_[a-z0-9_]+", exprs), f"use {name}_bucket for a histogram"
    # every documented metric is on the dashboard, by name or through a regex selector
    for name in documented:
        assert name in used or any(re.fullmatch(r, name) for r in regexes), f"{name} not on the dashboard"


def filter_metric_definitions():
    """Stat names defined by the filter source, as (static names, regex patterns)."""
    sources = sorted((meshlib.ROOT / "src").rglob("*.rs"))
    text = "\n".join(p.read_text(encoding="utf-8") for p in sources)
    static = set(re.findall(r'(?:Metric::(?:counter|gauge|histogram)|BatchedCounter::new)\("([^"{}]+)"\)', text))
    patterns = {re.sub(r"\{[a-z_]*\}", "{}", p)
                for p in re.findall(r'format!\("(kvroute\.[^"]*\{[a-z_]*\}[^"]*)"', text)}
    return static, patterns


def prom_name(stat: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", stat)


def test_guide_metrics_match_the_filter_source():
    static, patterns = filter_metric_definitions()
    if not static:
        pytest.skip("the filter defines no metrics yet (src/ has no Metric::counter/gauge/histogram)")
    documented = set(guide_metrics())
    defined = {prom_name(s) for s in static}
    regexes = [re.escape(prom_name(p.replace("{}", "XPLACEHOLDERX"))).replace("XPLACEHOLDERX", "[a-z0-9_]+") for p in patterns]
    missing = defined - documented
    assert not missing, f"defined by the filter but not in the guide's metrics table: {sorted(missing)}"
    unknown = {m for m in documented - defined if not any(re.fullmatch(r, m) for r in regexes)}
    assert not unknown, f"in the guide but not defined by the filter: {sorted(unknown)}"
    for r in regexes:
        assert any(re.fullmatch(r, m) for m in documented), f"no documented metric for the family {r}"


def test_guide_mentions_existing_files_and_targets():
    text = guide_text()
    for path in set(re.findall(r"`((?:istio|envoy|schema|docs|integration)/[A-Za-z0-9_./-]+)`", text)):
        path = path.rstrip(".")
        assert (meshlib.ROOT / path).exists(), path
    mk = (meshlib.ROOT / "mk" / "mesh.mk").read_text()
    for target in ("oci", "istio-render"):
        assert re.search(rf"^{target}:", mk, re.M), target


def test_guide_config_table_covers_the_schema():
    text = guide_text()
    section = text.split("## 5. Plugin configuration and weights", 1)[1].split("\n## 6.", 1)[0]
    for field in meshlib.plugin_config_schema()["properties"]:
        assert f"`{field}" in section, f"plugin config field {field} not documented in the guide"


def test_guide_names_the_shipped_weights():
    """The weights the guide says are shipped are the ones in the shipped configs."""
    text = guide_text()
    m = re.search(r"As shipped: `prefill ([0-9.]+), decode ([0-9.]+), queue ([0-9.]+), kv_usage ([0-9.]+)`", text)
    assert m
    shipped = [float(x) for x in m.groups()]
    filters = [c for w, c in meshlib.example_plugin_configs() if c.get("role", "filter") == "filter"
               and (w.startswith("istio/") or "mesh-" in w)]
    assert filters
    for cfg in filters:
        w = cfg["weights"]
        assert [w["prefill"], w["decode"], w["queue"], w["kv_usage"]] == shipped


def test_guide_config_defaults_match_the_schema():
    section = guide_text().split("## 5. Plugin configuration and weights", 1)[1].split("### What each weight does", 1)[0]
    props = meshlib.plugin_config_schema()["properties"]
    checked = 0
    for field, default in re.findall(r"^\|\s*`([a-z_]+)`\s*\|\s*`([^`]*)`\s*\|", section, re.M):
        assert field in props, field
        assert json.loads(default) == props[field]["default"], field
        checked += 1
    assert checked >= 12
    w = re.search(r"`weights.prefill`, `.decode`, `.queue`, `.kv_usage` \| `([^`]*)`", section).group(1)
    assert [float(x) for x in w.split(",")] == [props["weights"]["properties"][k]["default"]
                                                 for k in ("prefill", "decode", "queue", "kv_usage")]


# ---------------------------------------------------------------- the repository stands alone

# The design notes this project started from lived beside the repository; what the repository
# needs from them is now in docs/ and testdata/. Written as regexes so this file does not match.
OUTSIDE_REFERENCES = re.compile(
    r"\.\./shared\b"                                               # the sibling folder itself
    r"|\bshared/(?:design|benchmark|vllm-kv-events|README)\.md"     # its notes by path
    r"|\bshared/(?:vllm-golden|istio-crds|hooks)\b"                  # its data by path
    r"|(?<![\w./-])(?:design|benchmark)\.md\b"                       # its notes by bare name (no such file here)
)
# Benchmark data files are records of a run, not documentation.
RESULTS_DATA = re.compile(r"^docs/results/.+\.(?:json|tar\.gz|png)$")


def tracked_files() -> list[str]:
    """Paths relative to the root: git's index in a checkout, else every file outside build output."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=meshlib.ROOT, capture_output=True, check=True)
        return [p for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "target", "build", ".venv", ".venv-bench", "__pycache__", ".pytest_cache"}
        found = []
        for dirpath, dirnames, filenames in os.walk(meshlib.ROOT):
            dirnames[:] = [d for d in dirnames if d not in skip]
            found += [os.path.relpath(os.path.join(dirpath, f), meshlib.ROOT) for f in filenames]
        return found


def text_of(rel: str):
    """The file's text, or None for a binary file (or one deleted from the work tree)."""
    try:
        data = (meshlib.ROOT / rel).read_bytes()
    except FileNotFoundError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_outside_reference_pattern_catches_what_it_should():
    assert OUTSIDE_REFERENCES.search("see ../" "shared/design" ".md")
    assert OUTSIDE_REFERENCES.search("read from `" "shared/vllm" "-golden`")
    assert OUTSIDE_REFERENCES.search("as bench" "mark.md explains")
    assert not OUTSIDE_REFERENCES.search("docs/benchmark-method.md and docs/architecture.md")
    assert not OUTSIDE_REFERENCES.search("testdata/vllm-golden/frames, shared_prefix, shared data")


def test_no_file_points_outside_the_repository():
    files = tracked_files()
    assert "README.md" in files and "docs/architecture.md" in files
    offenders = []
    for rel in files:
        if RESULTS_DATA.match(rel):
            continue
        text = text_of(rel)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            m = OUTSIDE_REFERENCES.search(line)
            if m:
                offenders.append(f"{rel}:{lineno}: {m.group(0)}")
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)


MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def without_code(text: str) -> str:
    """Markdown text without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (duplicates get -1, -2, ...)."""
    anchors, seen = set(), {}
    for line in without_code(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link's text stays, its target goes
        slug = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_heading_anchors_follow_github():
    text = "# A\n## What Envoy 1.40 does (measured)\n## 4. Configuring vLLM for KV events\n## A\n```\n# not a heading\n```\n"
    assert heading_anchors(text) == {"a", "what-envoy-140-does-measured", "4-configuring-vllm-for-kv-events", "a-1"}


def test_relative_markdown_links_resolve():
    """Every relative link of every tracked Markdown file names an existing file, and an anchor
    into a Markdown file names one of its headings."""
    checked, dead = 0, []
    for rel in tracked_files():
        if not rel.endswith(".md"):
            continue
        text = text_of(rel)
        if text is None:
            continue
        for target in MD_LINK.findall(without_code(text)):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (meshlib.ROOT / rel).parent / path if path else meshlib.ROOT / rel
            checked += 1
            if not dest.exists():
                dead.append(f"{rel}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text(encoding="utf-8")):
                dead.append(f"{rel}: {target} (no such heading)")
            elif not dest.resolve().is_relative_to(meshlib.ROOT):
                dead.append(f"{rel}: {target} (outside the repository)")
    assert checked >= 20
    assert not dead, "dead links:\n" + "\n".join(dead)


# ---------------------------------------------------------------- make help

MAKEFILES = [meshlib.ROOT / "Makefile", *sorted((meshlib.ROOT / "mk").glob("*.mk"))]


def make_targets() -> dict[str, str]:
    """Every explicit target defined in Makefile and mk/*.mk -> its `## description` ('' if none)."""
    targets = {}
    for path in MAKEFILES:
        for line in path.read_text(encoding="utf-8").splitlines():
            m = re.match(r"^([a-zA-Z0-9_-]+)\s*:(?![:=])([^#]*)(?:##\s*(.*))?$", line)
            if m:
                targets[m.group(1)] = (m.group(3) or "").strip()
    return targets


def test_every_make_target_has_a_description():
    targets = make_targets()
    assert {"run", "test", "help", "bench", "indexer-test", "oci", "sim-test"} <= set(targets)
    missing = sorted(t for t, d in targets.items() if not d)
    assert not missing, f"make targets without a `## description` on their line: {missing}"


def test_make_help_lists_every_target():
    out = subprocess.run(["make", "--no-print-directory", "-s", "help"], cwd=meshlib.ROOT,
                         capture_output=True, text=True, check=True).stdout
    listed = dict(re.findall(r"^  (\S+)\s+(.+)$", out, re.M))
    assert listed == make_targets()


def test_help_is_the_default_goal_and_run_test_are_unchanged():
    default = subprocess.run(["make", "--no-print-directory", "-s"], cwd=meshlib.ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert default == subprocess.run(["make", "--no-print-directory", "-s", "help"], cwd=meshlib.ROOT,
                                     capture_output=True, text=True, check=True).stdout
    # -n prints the recipes without running them: `make test` still lints, unit-tests and runs e2e.
    test_plan = subprocess.run(["make", "--no-print-directory", "-n", "test"], cwd=meshlib.ROOT,
                               capture_output=True, text=True, check=True).stdout
    assert "cargo clippy" in test_plan and "cargo test --workspace" in test_plan and "-m pytest tests" in test_plan
    run_plan = subprocess.run(["make", "--no-print-directory", "-n", "run"], cwd=meshlib.ROOT,
                              capture_output=True, text=True, check=True).stdout
    assert "integration/run_local.py" in run_plan
