#!/usr/bin/env bash
# A first copy on a self-made demo image: builds mover, makes a 2 GiB sparse image with
# data, zeros and holes, copies it (full, verified), changes 1% of its pages, and copies
# again (delta). Needs no root, no cluster, no cloud account. Leaves files in $DEMO_DIR.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEMO_DIR=${DEMO_DIR:-/tmp/mover-demo}
cargo build --release -p mover --quiet
MOVER=$(realpath "${CARGO_TARGET_DIR:-target}/release/mover")
mkdir -p "$DEMO_DIR" && cd "$DEMO_DIR"
rm -f volume.img copy.img
export MOVER_STATE_DIR="$DEMO_DIR/state"

echo "== making volume.img: 2 GiB, 512 MiB of data, 128 MiB of written zeros, the rest holes"
truncate -s 2G volume.img
head -c 512M /dev/urandom | dd of=volume.img bs=1M seek=256 conv=notrunc status=none
dd if=/dev/zero of=volume.img bs=1M count=128 seek=1024 conv=notrunc status=none

echo "== full copy to a new image, verified by reading it back"
"$MOVER" copy volume.img copy.img --verify
echo "   allocated on disk: $(du -h copy.img | cut -f1) of $(du -h --apparent-size copy.img | cut -f1)"

echo "== changing 1% of the data pages (1310 scattered 4 KiB writes)"
for i in $(seq 1 1310); do
  echo "seek=$(( (256 * 256) + (RANDOM * 4 + i) % (512 * 256) ))"
done | while read -r s; do
  head -c 4096 /dev/urandom | dd of=volume.img bs=4096 "$s" conv=notrunc status=none
done

echo "== delta copy onto the older copy: only changed pages are written"
"$MOVER" copy volume.img copy.img --verify
"$MOVER" hash volume.img
"$MOVER" hash copy.img
