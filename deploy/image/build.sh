#!/usr/bin/env bash
# Builds the mover image from this repository, without a registry or a daemon:
#  - layer 1: a Debian 12 root file system made by mmdebstrap from Debian's packages
#    (Essential plus ./packages, without docs, man pages and locales), cached outside the
#    clone under the hash of its inputs;
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
mirror="${MOVER_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
mkdir -p "$cache"
command -v mmdebstrap >/dev/null || { echo "image/build.sh: mmdebstrap is needed (apt-get install mmdebstrap)" >&2; exit 1; }

version="$(awk -F'"' '/^version = / {print $2; exit}' "$repo/Cargo.toml")"
name="localhost/mover:$version"

# The package list without its comments.
packages="$(sed 's/#.*//' "$here/packages" | xargs | tr ' ' ',')"

base_layer() {
  # Deterministic: fixed timestamps, no docs or caches that differ between runs.
  SOURCE_DATE_EPOCH=1700000000 mmdebstrap --quiet --format=tar --variant=essential --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
    bookworm "$1.part" "$mirror"
  mv "$1.part" "$1"
}

stamp="$( (echo "$packages $mirror"; declare -f base_layer) | sha256sum | cut -c1-16)"
base="$cache/base-$stamp.tar"
if [ ! -f "$base" ]; then
  echo "image/build.sh: making the Debian base layer ($packages)" >&2
  base_layer "$base"
fi

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
