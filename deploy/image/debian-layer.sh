#!/usr/bin/env bash
# A Debian 12 (bookworm) root file system as one image layer: Essential plus PACKAGES
# (comma-separated), without docs, man pages and locales, made by mmdebstrap with fixed
# timestamps. Cached as $MOVER_IMAGE_CACHE/NAME-HASH.tar under the hash of its inputs
# (older NAME-*.tar removed: each is 200-400 MB); prints its path.
#
#   deploy/image/debian-layer.sh base e2fsprogs,xfsprogs    # mover's (build.sh)
#   deploy/image/debian-layer.sh postgres postgresql-15     # a test image's (images.sh)
#
# Needs mmdebstrap and deb.debian.org (or MOVER_DEBIAN_MIRROR).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: debian-layer.sh NAME PACKAGES" >&2; exit 2; }
name="$1" packages="$2"
cache="${MOVER_IMAGE_CACHE:-/var/tmp/mover-image}"
mirror="${MOVER_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
command -v mmdebstrap >/dev/null || { echo "debian-layer.sh: mmdebstrap is needed (apt-get install mmdebstrap)" >&2; exit 1; }
mkdir -p "$cache"

layer() {
  # Deterministic: fixed timestamps, no docs or caches that differ between runs.
  SOURCE_DATE_EPOCH=1700000000 mmdebstrap --quiet --format=tar --variant=essential --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
    bookworm "$1.part" "$mirror"
  mv "$1.part" "$1"
}

out="$cache/$name-$( (echo "$packages $mirror"; declare -f layer) | sha256sum | cut -c1-16).tar"
if [ ! -f "$out" ]; then
  echo "debian-layer.sh: making the $name layer ($packages)" >&2
  layer "$out"
  find "$cache" -maxdepth 1 -name "$name-*.tar" ! -path "$out" -delete
fi
echo "$out"
