#!/usr/bin/env python3
"""Writes an OCI image layout with random (incompressible) layers, for tests and the demo.

usage: make_image.py <out-dir> <tag> <layers> <bytes-per-layer> [seed]

Layers are real gzipped tars (containerd unpacks them; skopeo keeps gzip layers as they are,
so digests survive the push), each holding one file of random bytes. Prints the manifest digest.
"""
import gzip
import hashlib
import io
import json
import os
import random
import sys
import tarfile


def blob(root, data):
    digest = hashlib.sha256(data).hexdigest()
    path = os.path.join(root, "blobs", "sha256", digest)
    with open(path, "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + digest, "size": len(data)}


# randbytes() cannot make more than 256 MiB at once; large layers are built from chunks.
CHUNK = 16 * 1024 * 1024


def layer(index, size, rng):
    payload = b"".join(rng.randbytes(min(CHUNK, size - i)) for i in range(0, size, CHUNK))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name=f"data/layer-{index}.bin")
        info.size = len(payload)
        info.mtime = 0
        tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def main():
    out, tag, layers, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    seed = sys.argv[5] if len(sys.argv) > 5 else tag
    rng = random.Random(seed)
    os.makedirs(os.path.join(out, "blobs", "sha256"), exist_ok=True)
    layer_descs, diff_ids = [], []
    for i in range(layers):
        tar = layer(i, size, rng)
        # Random bytes do not compress: level 1 is as small as 9 and much faster.
        d = blob(out, gzip.compress(tar, compresslevel=1, mtime=0))
        d["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip"
        layer_descs.append(d)
        diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": ["/bin/true"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    config_desc = blob(out, json.dumps(config, sort_keys=True).encode())
    config_desc["mediaType"] = "application/vnd.oci.image.config.v1+json"
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": layer_descs,
    }
    manifest_desc = blob(out, json.dumps(manifest, sort_keys=True).encode())
    manifest_desc["mediaType"] = "application/vnd.oci.image.manifest.v1+json"
    manifest_desc["annotations"] = {"org.opencontainers.image.ref.name": tag}
    manifest_desc["platform"] = {"architecture": "amd64", "os": "linux"}
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [manifest_desc]}, f)
    with open(os.path.join(out, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    print(manifest_desc["digest"])


if __name__ == "__main__":
    main()
