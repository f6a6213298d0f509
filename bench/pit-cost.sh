#!/usr/bin/env bash
# What a replication cycle's point in time costs on a fragmented image, and how long it
# holds the volume's writers back (issue 52):
#  - fresh: one whole-file reflink clone (FICLONE), what a cycle takes when anything but
#    a file system mounted from the image may write into it (a raw block volume, a
#    process holding the file): the file system holds the image's lock for the clone,
#    so writers wait for all of it;
#  - catch-up: the last cycle's clone brought up to date range by range, what a cycle
#    takes when the only writers are file systems mounted from the image's loop devices:
#    those are frozen for the comparison and the reclones.
# A 4 GiB image on XFS holds an ext4 with PostgreSQL; 100k random 4 KiB pages are
# rewritten after a clone, so the image has about 100k extents. pgbench writes while
# `mover replicate run` takes a cycle a second, once each way (a process holding the
# image open forces the fresh clone); the agent's log gives each hold's time.
#
#   bench/pit-cost.sh [CYCLES]     # as root; MOVER=path/to/mover (default: the debug build)
set -euo pipefail
cd "$(dirname "$0")/.."
CYCLES=${1:-60}
MOVER=$(realpath "${MOVER:-${CARGO_TARGET_DIR:-target}/debug/mover}")
PG=/usr/lib/postgresql/15/bin
W=$(mktemp -d /var/tmp/pit-cost.XXXX)
PIDS=()
pgrun() { setpriv --reuid=postgres --regid=postgres --init-groups -- env PGHOST="$W/run" "$@"; }
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  fsfreeze --unfreeze "$W/pg" 2>/dev/null || true
  pgrun "$PG/pg_ctl" -s -D "$W/pg/data" -m immediate stop 2>/dev/null || true
  umount "$W/pg" 2>/dev/null || true
  umount "$W/xfs" 2>/dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
mkdir -p "$W"/{xfs,pg,b,run}
truncate -s 16G "$W/xfs.img" && mkfs.xfs -q "$W/xfs.img" && mount -o loop "$W/xfs.img" "$W/xfs"
IMG=$W/xfs/vol.img

echo "== a 4 GiB image, written whole, then 100k pages rewritten after a clone"
xfs_io -f -c "pwrite -q -b 8m 0 4g" -c fsync "$IMG"
cp --reflink=always "$IMG" "$W/xfs/snap"
python3 - "$IMG" <<'PY'
import os, random, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
rng = random.Random(52)
page = os.urandom(4096)
for _ in range(100_000):
    os.pwrite(fd, page, rng.randrange(4 << 30 >> 12) << 12)
os.fsync(fd)
PY
rm "$W/xfs/snap"
echo "extents: $(xfs_io -c 'fiemap' "$IMG" | grep -vc 'hole\|^/')"
mkfs.ext4 -q -F "$IMG"
mount -o loop "$IMG" "$W/pg"

echo "== PostgreSQL 15 on the ext4, pgbench scale 20"
chmod 755 "$W" "$W/pg"
mkdir -p "$W/pg/data" && chown -R postgres:postgres "$W/pg/data" "$W/run"
pgrun "$PG/initdb" -D "$W/pg/data" >/dev/null
pgrun "$PG/pg_ctl" -s -D "$W/pg/data" -o "-k $W/run -c listen_addresses=''" -l "$W/run/log" start
pgrun "$PG/pgbench" -q -i -s 20 postgres 2>/dev/null

echo "== the secondary's agent"
export MOVER_TOKEN=pit-cost-$$
echo "$MOVER_TOKEN" > "$W/b/token"
PORT=$((20000 + RANDOM % 20000))
cat > "$W/b/agent.toml" <<TOML
listen = "127.0.0.1:$PORT"
metrics_listen = "127.0.0.1:$((PORT + 1))"
state_dir = "$W/b/state"
token_file = "$W/b/token"
[exports.vol]
path = "$W/b/vol.img"
TOML
RUST_LOG=warn "$MOVER" agent --config "$W/b/agent.toml" & PIDS+=($!)
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done

# Runs CYCLES cycles (one a second) under pgbench; prints the holds' p50/p99/max.
cycles() {
  local log=$W/run/$1.log
  pgrun "$PG/pgbench" -c 4 -T 3600 postgres >"$W/run/$1.pgbench" 2>&1 & local bench=$!
  RUST_LOG=mover::replicate=debug "$MOVER" replicate run "$IMG" "agent://127.0.0.1:$PORT/vol" \
    --interval 1s --cycles "$CYCLES" --state-dir "$W/state" >"$W/run/$1.out" 2>"$log"
  kill $bench 2>/dev/null; wait $bench 2>/dev/null || true
  grep -o 'held writers back for [0-9.]* ms ([a-z -]*)' "$log" | sed -n '2,$p' |
    awk '{print $5, $7, $8, $9}' | sort -n | awk -v what="$1" '
      { t[NR] = $1; how[$2" "$3" "$4]++ }
      END {
        if (NR == 0) { print what ": no holds logged"; exit 1 }
        p99 = int(NR * 0.99 + 0.5); if (p99 > NR) p99 = NR
        printf "%s: %d cycles, holds p50 %.1f ms, p99 %.1f ms, max %.1f ms;", what, NR,
          t[int(NR * 0.5 + 0.5)], t[p99], t[NR]
        for (h in how) printf " %s x%d", h, how[h]
        print ""
      }'
}

echo "== cycles while only the ext4 writes: catch-up under a freeze"
cycles catch-up
echo "== cycles while a process holds the image open too: a fresh clone each"
sleep 100000 <"$IMG" & PIDS+=($!)
cycles fresh
