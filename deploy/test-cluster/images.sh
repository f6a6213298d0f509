#!/usr/bin/env bash
# The images the test nodes run besides mover's own (deploy/image/build.sh), packed as
# OCI archives without a registry by deploy/image/oci-pack.py, into $MOVER_KUBE_BIN/images:
#   localhost/pause:1        the pods' sandbox: Debian's busybox-static sleeping
#   registry.k8s.io/pause:3.10
#                            the same, named as the controller's snapshot reader pods
#                            name their image (csi_snapshots::READER_IMAGE)
#   localhost/busybox:1      the tests' workload pods: busybox-static with its applets
#   localhost/postgres:15    the tests' database pods: Debian 12's postgresql-15, mount, mkfs.ext4,
#                            made by mmdebstrap and cached under $MOVER_IMAGE_CACHE (as
#                            deploy/image/build.sh caches mover's base layer)
#   registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.15.0
#                            the registrar deploy/base runs beside each agent, built from
#                            its source by build.sh, named as deploy/base names it
# Prints the directory. Needs busybox-static and mmdebstrap (Debian) and build.sh's output.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${MOVER_KUBE_BIN:-/var/tmp/mover-kube/bin}"
out="$bin/images"
pack="$here/../image/oci-pack.py"
[ -x /bin/busybox ] || { echo "images.sh: /bin/busybox is missing: apt-get install busybox-static" >&2; exit 1; }
[ -x "$bin/csi-node-driver-registrar" ] || { echo "images.sh: run build.sh first" >&2; exit 1; }
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# layer NAME FILE:PATH...: a layer directory $work/NAME with each FILE at PATH (mode kept).
layer() {
  local name="$1" spec; shift
  mkdir -p "$work/$name"
  for spec in "$@"; do
    install -D "${spec%%:*}" "$work/$name/${spec#*:}"
  done
}

layer busybox /bin/busybox:bin/busybox
# Every applet as a link, as busybox --install would make.
for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -sf busybox "$work/busybox/bin/$a"; done
mkdir -p "$work/busybox/tmp" "$work/busybox/etc"; chmod 1777 "$work/busybox/tmp"
python3 "$pack" --name localhost/busybox:1 --out "$out/busybox.oci.tar" --cmd '["/bin/sh"]' "$work/busybox" >/dev/null
# The sandbox holds the pod's namespaces; runc kills it with SIGKILL.
python3 "$pack" --name localhost/pause:1 --out "$out/pause.oci.tar" \
  --entrypoint '["/bin/sleep", "2147483647"]' "$work/busybox" >/dev/null
python3 "$pack" --name registry.k8s.io/pause:3.10 --out "$out/pause-3.10.oci.tar" \
  --entrypoint '["/bin/sleep", "2147483647"]' "$work/busybox" >/dev/null

# The database image: one layer, rebuilt only when what makes it changes.
postgres="$("$here/../image/debian-layer.sh" postgres postgresql-15,mount,e2fsprogs)"
python3 "$pack" --name localhost/postgres:15 --out "$out/postgres.oci.tar" \
  --env PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --cmd '["/bin/sh"]' "$postgres" >/dev/null

layer registrar "$bin/csi-node-driver-registrar:csi-node-driver-registrar"
python3 "$pack" --name registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.15.0 \
  --out "$out/csi-node-driver-registrar.oci.tar" --entrypoint '["/csi-node-driver-registrar"]' \
  "$work/registrar" >/dev/null
echo "$out"
