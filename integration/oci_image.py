#!/usr/bin/env python3
"""Package kvroute.wasm as an OCI image for Istio/Envoy `oci://` loading, without a container engine.

Writes an OCI image layout (https://github.com/opencontainers/image-spec/blob/main/image-layout.md)
holding two manifests of the same module, and a tarball of that layout:

* tag VERSION          -- the Wasm image spec *oci* variant (what Istio's agent prefers):
                          config  application/vnd.module.wasm.config.v1+json
                          1 layer application/vnd.module.wasm.content.layer.v1+wasm (the raw module)
* tag VERSION-compat   -- the *compat* variant: an ordinary single-layer image whose layer is an
                          uncompressed tar holding `plugin.wasm` (for registries that refuse custom
                          media types; Istio's agent reads it as well).

Stdlib only. Output is reproducible: same module + version -> same digests.

    python3 integration/oci_image.py --wasm target/wasm32-wasip1/release/kvroute.wasm \
        --version 0.1.0 --out build/oci
    python3 integration/oci_image.py --verify build/oci/kvroute-wasm

Push with any OCI-layout-aware tool, e.g.
    skopeo copy oci:build/oci/kvroute-wasm:0.1.0 docker://REGISTRY/kvroute-wasm:0.1.0
    oras cp --from-oci-layout build/oci/kvroute-wasm:0.1.0 REGISTRY/kvroute-wasm:0.1.0
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
WASM_CONFIG = "application/vnd.module.wasm.config.v1+json"
WASM_LAYER = "application/vnd.module.wasm.content.layer.v1+wasm"
REF_NAME = "org.opencontainers.image.ref.name"
VARIANT_ANNOTATION = "module.wasm.image/variant"
WASM_MAGIC = b"\x00asm\x01\x00\x00\x00"
COMPAT_FILE = "plugin.wasm"
IMAGE_NAME = "kvroute-wasm"


def canonical_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Layout:
    """An OCI image layout being written: blobs/sha256/<hex>, oci-layout, index.json."""

    def __init__(self, root: Path):
        self.root = root
        self.blobs = root / "blobs" / "sha256"
        self.blobs.mkdir(parents=True, exist_ok=True)

    def put(self, data: bytes, media_type: str, annotations: dict | None = None) -> dict:
        digest = sha256_digest(data)
        path = self.blobs / digest.split(":", 1)[1]
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        desc = {"mediaType": media_type, "digest": digest, "size": len(data)}
        if annotations:
            desc["annotations"] = annotations
        return desc


def compat_layer(wasm: bytes) -> bytes:
    """Uncompressed tar with the single file plugin.wasm, fixed metadata (reproducible)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(COMPAT_FILE)
        info.size = len(wasm)
        info.mode = 0o444
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(wasm))
    return buf.getvalue()


def build(wasm_path: Path, version: str, out_dir: Path, source: str = "") -> dict:
    wasm = wasm_path.read_bytes()
    if not wasm.startswith(WASM_MAGIC):
        raise SystemExit(f"{wasm_path}: not a WebAssembly binary module (bad magic/version)")
    layout_dir = out_dir / IMAGE_NAME
    if layout_dir.exists():
        # rebuild from scratch so no stale blob survives
        for p in sorted(layout_dir.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    layout = Layout(layout_dir)
    common = {"org.opencontainers.image.title": "kvroute.wasm", "org.opencontainers.image.version": version}
    if source:
        common["org.opencontainers.image.source"] = source

    # oci variant
    cfg = layout.put(canonical_json({}), WASM_CONFIG)
    layer = layout.put(wasm, WASM_LAYER, {"org.opencontainers.image.title": "kvroute.wasm"})
    m_oci = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": cfg, "layers": [layer], "annotations": common}
    d_oci = layout.put(canonical_json(m_oci), OCI_MANIFEST, {REF_NAME: version})

    # compat variant
    tar = compat_layer(wasm)
    image_config = {
        "architecture": "wasm",
        "os": "wasip1",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [sha256_digest(tar)]},
    }
    cfg_c = layout.put(canonical_json(image_config), OCI_CONFIG)
    layer_c = layout.put(tar, OCI_LAYER_TAR)
    m_compat = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": cfg_c,
        "layers": [layer_c],
        "annotations": {**common, VARIANT_ANNOTATION: "compat"},
    }
    d_compat = layout.put(canonical_json(m_compat), OCI_MANIFEST, {REF_NAME: f"{version}-compat"})

    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [d_oci, d_compat]}
    (layout_dir / "index.json").write_bytes(canonical_json(index))
    (layout_dir / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))

    tar_path = out_dir / f"{IMAGE_NAME}-{version}.oci.tar"
    write_layout_tar(layout_dir, tar_path)
    summary = {
        "layout": str(layout_dir),
        "tarball": str(tar_path),
        "version": version,
        "module_sha256": hashlib.sha256(wasm).hexdigest(),
        "oci": {"ref": version, "manifest_digest": d_oci["digest"]},
        "compat": {"ref": f"{version}-compat", "manifest_digest": d_compat["digest"]},
    }
    (out_dir / f"{IMAGE_NAME}-{version}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_layout_tar(layout_dir: Path, tar_path: Path) -> None:
    """A reproducible tar of the layout (what `skopeo copy oci-archive:` and `docker load` read)."""
    tmp = tar_path.with_suffix(".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(layout_dir.rglob("*")):
            rel = p.relative_to(layout_dir).as_posix()
            info = tarfile.TarInfo(rel)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if p.is_dir():
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                data = p.read_bytes()
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, tar_path)


# ---------------------------------------------------------------------------
# Verification (used by `make oci` and by tests/mesh/test_oci_image.py)


class VerifyError(Exception):
    pass


def _blob(layout_dir: Path, desc: dict) -> bytes:
    digest = desc.get("digest", "")
    if not digest.startswith("sha256:") or len(digest) != 71:
        raise VerifyError(f"bad digest {digest!r}")
    path = layout_dir / "blobs" / "sha256" / digest[7:]
    if not path.is_file():
        raise VerifyError(f"missing blob {digest}")
    data = path.read_bytes()
    if sha256_digest(data) != digest:
        raise VerifyError(f"blob {digest} content hashes to {sha256_digest(data)}")
    if len(data) != desc.get("size"):
        raise VerifyError(f"blob {digest} size {len(data)} != descriptor size {desc.get('size')}")
    return data


def verify(layout_dir: Path) -> dict[str, bytes]:
    """Check every digest and size, the media types of both variants; return ref -> module bytes."""
    layout_dir = Path(layout_dir)
    if json.loads((layout_dir / "oci-layout").read_text()) != {"imageLayoutVersion": "1.0.0"}:
        raise VerifyError("oci-layout must be {'imageLayoutVersion': '1.0.0'}")
    index = json.loads((layout_dir / "index.json").read_text())
    if index.get("schemaVersion") != 2 or index.get("mediaType") != OCI_INDEX:
        raise VerifyError("index.json: schemaVersion 2 and the OCI index media type required")
    modules: dict[str, bytes] = {}
    referenced = set()
    for desc in index["manifests"]:
        if desc.get("mediaType") != OCI_MANIFEST:
            raise VerifyError(f"index entry media type {desc.get('mediaType')}")
        ref = desc.get("annotations", {}).get(REF_NAME)
        if not ref:
            raise VerifyError("index entry without org.opencontainers.image.ref.name")
        manifest = json.loads(_blob(layout_dir, desc))
        referenced.add(desc["digest"])
        if manifest.get("schemaVersion") != 2 or manifest.get("mediaType") != OCI_MANIFEST:
            raise VerifyError(f"{ref}: manifest schemaVersion/mediaType")
        layers = manifest.get("layers", [])
        if len(layers) != 1:
            raise VerifyError(f"{ref}: a wasm image has exactly one layer, found {len(layers)}")
        cfg_data = _blob(layout_dir, manifest["config"])
        layer_data = _blob(layout_dir, layers[0])
        referenced.update({manifest["config"]["digest"], layers[0]["digest"]})
        compat = manifest.get("annotations", {}).get(VARIANT_ANNOTATION) == "compat"
        if not compat:
            if manifest["config"]["mediaType"] != WASM_CONFIG or layers[0]["mediaType"] != WASM_LAYER:
                raise VerifyError(f"{ref}: oci variant needs {WASM_CONFIG} config and {WASM_LAYER} layer")
            json.loads(cfg_data)
            module = layer_data
        else:
            if manifest["config"]["mediaType"] != OCI_CONFIG or layers[0]["mediaType"] != OCI_LAYER_TAR:
                raise VerifyError(f"{ref}: compat variant needs {OCI_CONFIG} config and {OCI_LAYER_TAR} layer")
            config = json.loads(cfg_data)
            if config.get("rootfs", {}).get("diff_ids") != [sha256_digest(layer_data)]:
                raise VerifyError(f"{ref}: rootfs.diff_ids does not match the layer")
            with tarfile.open(fileobj=io.BytesIO(layer_data)) as tar:
                names = tar.getnames()
                if names != [COMPAT_FILE]:
                    raise VerifyError(f"{ref}: compat layer must hold only {COMPAT_FILE}, has {names}")
                module = tar.extractfile(COMPAT_FILE).read()
        if not module.startswith(WASM_MAGIC):
            raise VerifyError(f"{ref}: layer is not a WebAssembly module")
        modules[ref] = module
    on_disk = {"sha256:" + p.name for p in (layout_dir / "blobs" / "sha256").iterdir()}
    if on_disk != referenced:
        raise VerifyError(f"unreferenced or missing blobs: {sorted(on_disk ^ referenced)}")
    return modules


def cargo_version(cargo_toml: Path) -> str:
    in_package = False
    for line in cargo_toml.read_text().splitlines():
        s = line.strip()
        if s.startswith("["):
            in_package = s == "[package]"
        elif in_package and s.startswith("version") and "=" in s:
            return s.split("=", 1)[1].strip().strip('"')
    raise SystemExit(f"no [package] version in {cargo_toml}")


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wasm", type=Path, default=root / "target/wasm32-wasip1/release/kvroute.wasm")
    ap.add_argument("--version", default=None, help="image tag (default: the kvroute crate version)")
    ap.add_argument("--out", type=Path, default=root / "build/oci")
    ap.add_argument("--source", default="", help="org.opencontainers.image.source annotation")
    ap.add_argument("--verify", type=Path, metavar="LAYOUT_DIR", help="only verify an existing layout")
    args = ap.parse_args(argv)
    if args.verify:
        try:
            modules = verify(args.verify)
        except (VerifyError, OSError, ValueError, KeyError) as e:
            print(f"oci_image: {args.verify}: INVALID: {e}", file=sys.stderr)
            return 1
        for ref, module in modules.items():
            print(f"{ref}: ok, module sha256 {hashlib.sha256(module).hexdigest()} ({len(module)} bytes)")
        return 0
    version = args.version or cargo_version(root / "Cargo.toml")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = build(args.wasm, version, args.out, args.source)
    verify(Path(summary["layout"]))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
