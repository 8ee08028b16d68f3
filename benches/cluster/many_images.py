#!/usr/bin/env python3
"""Writes an OCI archive (a tar) of many tiny images, for `ctr images import`: each image has a
manifest, a config and two small layers of its own, so N images are 4*N distinct digests.

usage: many_images.py <out.tar> <name-prefix> <count>
Image i is named <name-prefix>:t<i> (annotation io.containerd.image.name). Prints the layer
digests, one per line.
"""
import hashlib
import io
import json
import sys
import tarfile


def main():
    out, prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    blobs, manifests, layer_digests = {}, [], []

    def blob(data, media_type):
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}

    for i in range(count):
        # Never unpacked (imported with --no-unpack): the layer bytes only need to be distinct.
        layers = [
            blob(f"{prefix} image {i} layer {j}\n".encode(), "application/vnd.oci.image.layer.v1.tar")
            for j in range(2)
        ]
        layer_digests.extend(l["digest"] for l in layers)
        config = {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [l["digest"] for l in layers]},
        }
        cfg = blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": cfg,
            "layers": layers,
        }
        m = blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
        m["annotations"] = {
            "io.containerd.image.name": f"{prefix}:t{i}",
            "org.opencontainers.image.ref.name": f"t{i}",
        }
        manifests.append(m)

    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": manifests}
    with tarfile.open(out, "w") as tar:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        add("index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            add(f"blobs/sha256/{digest}", data)
    print("\n".join(layer_digests))


if __name__ == "__main__":
    main()
