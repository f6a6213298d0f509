#!/usr/bin/env bash
# Builds the mover image from this repository, without a registry or a daemon:
#  - layer 1: a Debian 12 root file system made by mmdebstrap from Debian's packages
#    (Essential plus ./packages, without docs, man pages and locales: ./debian-layer.sh),
#    cached outside the clone under the hash of its inputs;
#  - layer 2: the release build of `mover` at /usr/local/bin/mover (its entrypoint).
# Packed by ./oci-pack.py as an OCI archive named localhost/mover:VERSION (VERSION from
# Cargo.toml: the tag deploy/base's kustomization names). Prints the archive's path.
#
#   deploy/image/build.sh                      # cargo build --release, then the image
#   MOVER_BINARY=path/to/mover build.sh        # an already built binary instead
#   MOVER_IMAGE_CACHE=/somewhere build.sh      # default /var/tmp/mover-image
#
# Load it into a node's containerd:  ctr -n k8s.io image import ARCHIVE
# Push it to a registry:             skopeo copy oci-archive:ARCHIVE docker://REGISTRY/mover:VERSION
# Needs mmdebstrap and python3, and deb.debian.org (or MOVER_DEBIAN_MIRROR). A cold build
# of the base layer takes about a minute; later runs only pack the binary.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${MOVER_IMAGE_CACHE:-/var/tmp/mover-image}"
mkdir -p "$cache"

version="$(awk -F'"' '/^version = / {print $2; exit}' "$repo/Cargo.toml")"
name="localhost/mover:$version"

# The package list without its comments.
packages="$(sed 's/#.*//' "$here/packages" | xargs | tr ' ' ',')"

base="$("$here/debian-layer.sh" base "$packages")"

binary="${MOVER_BINARY:-}"
if [ -z "$binary" ]; then
  echo "image/build.sh: cargo build --release -p mover" >&2
  (cd "$repo" && cargo build --release --locked -p mover --quiet)
  binary="${CARGO_TARGET_DIR:-$repo/target}/release/mover"
fi
# The binary's layer: debug line tables dropped (a third of the size), symbols kept for
# backtraces.
layer="$(mktemp -d "$cache/layer.XXXXXX")"
trap 'rm -rf "$layer"' EXIT
mkdir -p "$layer/root/usr/local/bin"
strip --strip-debug -o "$layer/root/usr/local/bin/mover" "$binary"

out="$cache/mover-$version.oci.tar"
python3 "$here/oci-pack.py" --name "$name" --out "$out" \
  --entrypoint '["/usr/local/bin/mover"]' "$base" "$layer/root" >/dev/null
echo "$out"
