"""OCI image of kvroute.wasm (integration/oci_image.py): layout, media types, digests, tarball."""

import hashlib
import json
import subprocess
import sys
import tarfile

import pytest

import meshlib
import oci_image

# Smallest valid WebAssembly module (magic + version, no sections); used only when the real
# module has not been built (never in CI, where `make test` builds it first).
TINY_WASM = b"\x00asm\x01\x00\x00\x00"


@pytest.fixture(scope="module")
def module_bytes():
    if meshlib.WASM_PATH.exists():
        return meshlib.WASM_PATH.read_bytes()
    if meshlib.in_ci():
        pytest.fail(f"{meshlib.WASM_PATH} missing in CI: `make build` must run before the tests")
    return TINY_WASM


@pytest.fixture()
def built(tmp_path, module_bytes):
    wasm = tmp_path / "kvroute.wasm"
    wasm.write_bytes(module_bytes)
    out = tmp_path / "oci"
    summary = oci_image.build(wasm, "9.8.7", out)
    return summary, out / "kvroute-wasm", module_bytes


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob(layout, digest):
    return (layout / "blobs" / "sha256" / digest.split(":")[1]).read_bytes()


def test_layout_and_digests_recomputed(built):
    summary, layout, module = built
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_text())
    assert index["schemaVersion"] == 2
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    refs = {m["annotations"]["org.opencontainers.image.ref.name"]: m for m in index["manifests"]}
    assert set(refs) == {"9.8.7", "9.8.7-compat"}
    # every blob file is named by the sha256 of its content, every descriptor's size is right
    for p in (layout / "blobs" / "sha256").iterdir():
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name
    for desc in index["manifests"]:
        data = blob(layout, desc["digest"])
        assert sha(data) == desc["digest"] and len(data) == desc["size"]
    assert summary["oci"]["manifest_digest"] == refs["9.8.7"]["digest"]
    assert summary["module_sha256"] == hashlib.sha256(module).hexdigest()


def test_oci_variant_is_istio_wasm_format(built):
    _, layout, module = built
    index = json.loads((layout / "index.json").read_text())
    desc = next(m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == "9.8.7")
    manifest = json.loads(blob(layout, desc["digest"]))
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.module.wasm.config.v1+json"
    assert len(manifest["layers"]) == 1
    layer = manifest["layers"][0]
    assert layer["mediaType"] == "application/vnd.module.wasm.content.layer.v1+wasm"
    assert layer["digest"] == sha(module) and layer["size"] == len(module)
    assert blob(layout, layer["digest"]) == module
    cfg = blob(layout, manifest["config"]["digest"])
    assert sha(cfg) == manifest["config"]["digest"] and len(cfg) == manifest["config"]["size"]
    json.loads(cfg)


def test_compat_variant_holds_plugin_wasm(built):
    _, layout, module = built
    index = json.loads((layout / "index.json").read_text())
    desc = next(m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == "9.8.7-compat")
    manifest = json.loads(blob(layout, desc["digest"]))
    assert manifest["annotations"]["module.wasm.image/variant"] == "compat"
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    data = blob(layout, layer["digest"])
    assert sha(data) == layer["digest"]
    config = json.loads(blob(layout, manifest["config"]["digest"]))
    assert config["rootfs"] == {"type": "layers", "diff_ids": [sha(data)]}
    import io

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["plugin.wasm"]
        assert tar.extractfile("plugin.wasm").read() == module


def test_tarball_equals_layout(built):
    summary, layout, _ = built
    with tarfile.open(summary["tarball"]) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        files = {p.relative_to(layout).as_posix() for p in layout.rglob("*") if p.is_file()}
        assert set(members) == files
        for name in files:
            assert tar.extractfile(members[name]).read() == (layout / name).read_bytes()


def test_reproducible(tmp_path, module_bytes):
    wasm = tmp_path / "m.wasm"
    wasm.write_bytes(module_bytes)
    a = oci_image.build(wasm, "1.0.0", tmp_path / "a")
    b = oci_image.build(wasm, "1.0.0", tmp_path / "b")
    assert a["oci"] == b["oci"] and a["compat"] == b["compat"]
    assert (tmp_path / "a" / "kvroute-wasm-1.0.0.oci.tar").read_bytes() == (tmp_path / "b" / "kvroute-wasm-1.0.0.oci.tar").read_bytes()


def test_verify_detects_tampering(built):
    _, layout, module = built
    assert set(oci_image.verify(layout)) == {"9.8.7", "9.8.7-compat"}
    layer = layout / "blobs" / "sha256" / hashlib.sha256(module).hexdigest()
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    with pytest.raises(oci_image.VerifyError, match="hashes to"):
        oci_image.verify(layout)


def test_refuses_non_wasm(tmp_path):
    bad = tmp_path / "x.wasm"
    bad.write_bytes(b"\x7fELF....")
    with pytest.raises(SystemExit):
        oci_image.build(bad, "1", tmp_path / "o")


def test_cli_build_and_verify_real_module(tmp_path, module_bytes):
    """What `make oci` runs, on the real module when it is built."""
    wasm = tmp_path / "kvroute.wasm"
    wasm.write_bytes(module_bytes)
    tool = meshlib.ROOT / "integration" / "oci_image.py"
    res = subprocess.run([sys.executable, str(tool), "--wasm", str(wasm), "--out", str(tmp_path / "oci")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["version"] == oci_image.cargo_version(meshlib.ROOT / "Cargo.toml")
    res = subprocess.run([sys.executable, str(tool), "--verify", summary["layout"]], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert hashlib.sha256(module_bytes).hexdigest() in res.stdout


def test_make_oci(tmp_path, module_bytes):
    """`make oci` (mk/mesh.mk) writes a verified layout and tarball from the built module."""
    if not meshlib.WASM_PATH.exists():
        pytest.skip("make oci packages the built module; not built here (CI builds it)")
    # -o: the test runs inside the venv already; never let make rebuild it here
    res = subprocess.run(["make", "-s", "-o", ".venv/.installed", "oci", f"OCI_OUT={tmp_path}", "OCI_VERSION=7.7.7",
                          f"PY={sys.executable}"], cwd=meshlib.ROOT,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "kvroute-wasm-7.7.7.oci.tar").is_file()
    modules = oci_image.verify(tmp_path / "kvroute-wasm")
    assert modules == {"7.7.7": module_bytes, "7.7.7-compat": module_bytes}
