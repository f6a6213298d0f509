#!/usr/bin/env python3
"""Packs layer tarballs into an OCI image archive, without a registry or a daemon.

    oci-pack.py --name localhost/mover:0.1.0 --out mover.oci.tar \
        --entrypoint '["/usr/local/bin/mover"]' [--env K=V ...] LAYER ...

A LAYER is a tarball, or a directory packed here the one way every image of this
repository packs one: names sorted, times fixed, owned by root (numeric ids).

The archive (oci-layout, index.json, blobs/sha256/...) is what `ctr image import`,
`skopeo copy oci-archive:...` and `podman load` read; its index names the image with the
annotations containerd (io.containerd.image.name) and the OCI spec (ref.name) look for.
Layers are gzip-compressed with a zero mtime, so the same inputs give the same digests.
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile


def blob(blobs, data):
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobs, digest), "wb") as f:
        f.write(data)
    return "sha256:" + digest, len(data)


# The time every file of a layer packed from a directory carries.
MTIME = 1700000000


def layer_bytes(path):
    """The uncompressed tar of layer `path`: the file as it is, or the directory packed
    deterministically (the same tree gives the same bytes)."""
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            return f.read()

    def normalize(info):
        info.mtime = MTIME
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        # add() recurses in sorted order; the top level is sorted here.
        for name in sorted(os.listdir(path)):
            t.add(os.path.join(path, name), arcname=name, filter=normalize)
    return buf.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="the image's full reference, e.g. localhost/mover:0.1.0")
    p.add_argument("--out", required=True, help="the OCI archive to write")
    p.add_argument("--entrypoint", default="null", help="a JSON array")
    p.add_argument("--cmd", default="null", help="a JSON array")
    p.add_argument("--env", action="append", default=[], help="K=V, repeatable")
    p.add_argument("layers", nargs="+", help="uncompressed layer tarballs or directories, lowest first")
    a = p.parse_args()

    work = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(a.out)))
    try:
        blobs = os.path.join(work, "blobs", "sha256")
        os.makedirs(blobs)
        layers, diff_ids = [], []
        for path in a.layers:
            raw = layer_bytes(path)
            diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
            digest, size = blob(blobs, gzip.compress(raw, compresslevel=1, mtime=0))
            layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": size})
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + a.env,
                "Entrypoint": json.loads(a.entrypoint),
                "Cmd": json.loads(a.cmd),
            },
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        cdigest, csize = blob(blobs, json.dumps(config, sort_keys=True).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdigest, "size": csize},
            "layers": layers,
        }
        mdigest, msize = blob(blobs, json.dumps(manifest, sort_keys=True).encode())
        tag = a.name.rsplit(":", 1)[1] if ":" in a.name.rsplit("/", 1)[-1] else "latest"
        index = {
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": mdigest,
                "size": msize,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": a.name, "org.opencontainers.image.ref.name": tag},
            }],
        }
        with open(os.path.join(work, "index.json"), "w") as f:
            json.dump(index, f, sort_keys=True)
        with open(os.path.join(work, "oci-layout"), "w") as f:
            json.dump({"imageLayoutVersion": "1.0.0"}, f)
        tmp = a.out + ".part"
        with tarfile.open(tmp, "w") as t:
            for entry in ["oci-layout", "index.json", "blobs"]:
                t.add(os.path.join(work, entry), arcname=entry)
        os.replace(tmp, a.out)
        print(mdigest)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
