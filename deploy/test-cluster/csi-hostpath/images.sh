#!/usr/bin/env bash
# The images of the CSI stack that ./kustomization.yaml runs as pods, packed as OCI
# archives without a registry by deploy/image/oci-pack.py, into $MOVER_KUBE_BIN/images
# (default /var/tmp/mover-kube/bin/images), from the binaries ../build.sh built:
#   localhost/csi-hostpath/hostpathplugin:VERSION         the driver, on the Debian base
#       layer of mover's image (deploy/image/build.sh): it execs losetup, mount, umount,
#       findmnt, fallocate, cp, dd and tar
#   localhost/csi-hostpath/csi-provisioner:VERSION        \
#   localhost/csi-hostpath/csi-snapshotter:VERSION         | each its static binary at
#   localhost/csi-hostpath/snapshot-controller:VERSION     | /NAME (the entrypoint) and /tmp
#   localhost/csi-hostpath/csi-snapshot-metadata:VERSION  /
# VERSIONs are CSI_VERSIONS in ../build.sh; this script fails if kustomization.yaml names
# other tags. The registrar and pause images are ../images.sh's. Prints the directory.
#
#   deploy/test-cluster/csi-hostpath/images.sh
#   MOVER_IMAGE_BASE=/path/base-HASH.tar images.sh   # default: the newest
#                                                    # $MOVER_IMAGE_CACHE/base-*.tar
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${MOVER_KUBE_BIN:-/var/tmp/mover-kube/bin}"
out="$bin/images"
pack="$here/../../image/oci-pack.py"
die() { echo "csi-hostpath/images.sh: $*" >&2; exit 1; }

base="${MOVER_IMAGE_BASE:-$(ls -t "${MOVER_IMAGE_CACHE:-/var/tmp/mover-image}"/base-*.tar 2>/dev/null | head -n 1)}"
[ -f "$base" ] || die "no Debian base layer: run deploy/image/build.sh (or set MOVER_IMAGE_BASE)"
for b in hostpathplugin csi-provisioner csi-snapshotter snapshot-controller csi-snapshot-metadata; do
  [ -x "$bin/$b" ] || die "$bin/$b is missing: run deploy/test-cluster/build.sh"
done

# The version CSI_VERSIONS (in build.sh, the one place they are recorded) gives module $1.
versions="$(sed -n '/^CSI_VERSIONS="/,/^"/p' "$here/../build.sh")"
version() {
  local v
  v="$(awk -v m="$1" '$2 == m {print $3}' <<<"$versions")"
  [ -n "$v" ] || die "no version of $1 in build.sh's CSI_VERSIONS"
  echo "$v"
}

mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# image NAME VERSION [BASE]: localhost/csi-hostpath/NAME:VERSION into $out/csi-hostpath-NAME.oci.tar,
# $bin/NAME at /NAME as its entrypoint, over the layer BASE if given.
image() {
  local name="$1" version="$2" ref="localhost/csi-hostpath/$1:$2"
  shift 2
  grep -A1 -x "    newName: localhost/csi-hostpath/$name" "$here/kustomization.yaml" | grep -qx "    newTag: $version" \
    || die "kustomization.yaml does not name $ref"
  mkdir -p "$work/$name/tmp"
  chmod 1777 "$work/$name/tmp"
  install -m 0755 "$bin/$name" "$work/$name/$name"
  python3 "$pack" --name "$ref" --out "$out/csi-hostpath-$name.oci.tar" \
    --entrypoint "[\"/$name\"]" "$@" "$work/$name" >/dev/null
}

image hostpathplugin "$(version github.com/kubernetes-csi/csi-driver-host-path)" "$base"
image csi-provisioner "$(version github.com/kubernetes-csi/external-provisioner/v6)"
image csi-snapshotter "$(version github.com/kubernetes-csi/external-snapshotter/v8)"
image snapshot-controller "$(version github.com/kubernetes-csi/external-snapshotter/v8)"
image csi-snapshot-metadata "$(version github.com/kubernetes-csi/external-snapshot-metadata)"
echo "$out"
