#!/usr/bin/env bash
# The main job on built-in defaults: continuous replication between two local agents.
# Builds mover, makes a 1 GiB volume image with data, starts agent A (primary, node a)
# and agent B (secondary, node b) on 127.0.0.1, creates a relationship, runs cycles
# while the volume changes, then a planned failover to B and a failback to A, printing
# RPO and bytes shipped. Needs no root, no cluster, no cloud account. Leaves files in
# $DEMO_DIR; the agents are stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEMO_DIR=${DEMO_DIR:-/tmp/mover-demo}
cargo build --release -p mover --quiet
MOVER=$(realpath "${CARGO_TARGET_DIR:-target}/release/mover")
rm -rf "$DEMO_DIR" && mkdir -p "$DEMO_DIR"/{a,b} && cd "$DEMO_DIR"
export MOVER_TOKEN=demo-token-$$
echo "$MOVER_TOKEN" > token
PORT_A=${PORT_A:-17070} PORT_B=${PORT_B:-17071}

for side in a b; do
  port=$PORT_A; [ $side = b ] && port=$PORT_B
  cat > $side/agent.toml <<TOML
listen = "127.0.0.1:$port"
metrics_listen = "127.0.0.1:$((port + 100))"
state_dir = "$DEMO_DIR/$side/state"
token_file = "$DEMO_DIR/token"
advertise = "127.0.0.1:$port"
[exports.data]
path = "$DEMO_DIR/$side/data.img"
TOML
done

echo "== node a: a 1 GiB volume with 256 MiB of data (the rest holes)"
truncate -s 1G a/data.img
head -c 256M /dev/urandom | dd of=a/data.img bs=1M seek=64 conv=notrunc status=none

echo "== starting agent a (:$PORT_A) and agent b (:$PORT_B)"
RUST_LOG=warn "$MOVER" agent --config a/agent.toml & PID_A=$!
RUST_LOG=warn "$MOVER" agent --config b/agent.toml & PID_B=$!
trap 'kill $PID_A $PID_B 2>/dev/null || true' EXIT
for port in $PORT_A $PORT_B; do
  for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done
done
A=agent://127.0.0.1:$PORT_A B=agent://127.0.0.1:$PORT_B

scribble() { # N random 4 KiB pages of the volume on node $1
  for _ in $(seq "$2"); do
    head -c 4096 /dev/urandom | dd of="$1/data.img" bs=4096 seek=$(( (RANDOM * 32768 + RANDOM) % 262144 )) conv=notrunc status=none
  done
}

echo "== replicate a -> b every 5s (the first cycle copies the volume)"
"$MOVER" replicate create pg --agent $A --volume data --secondary $B/data --interval 5s
"$MOVER" replicate sync pg --agent $A
for round in 1 2 3; do
  echo "== round $round: 200 pages written on a, then a cycle"
  scribble a 200
  "$MOVER" replicate sync pg --agent $A | sed -n 2p
done
echo "== volumes equal after the last cycle:"
"$MOVER" hash a/data.img | sed -n 1p
"$MOVER" hash b/data.img | sed -n 1p

echo "== planned failover: demote a (final cycle), promote b"
scribble a 50
"$MOVER" replicate demote pg --agent $A
"$MOVER" replicate promote pg --agent $B
echo "== b is primary now; its writes replicate back to a"
scribble b 100
"$MOVER" replicate sync pg --agent $B

echo "== failback: demote b, promote a"
"$MOVER" replicate demote pg --agent $B
"$MOVER" replicate promote pg --agent $A
"$MOVER" replicate sync pg --agent $A
"$MOVER" replicate list --agent $A
"$MOVER" replicate list --agent $B
echo "== volumes equal:"
"$MOVER" hash a/data.img | sed -n 1p
"$MOVER" hash b/data.img | sed -n 1p
echo "== metrics on a:"
curl -s http://127.0.0.1:$((PORT_A + 100))/metrics 2>/dev/null | grep -E '^mover_replication_(rpo_seconds|bytes_shipped_total|cycles_total)' || true
