#!/usr/bin/env bash
# A Kubernetes cluster with real nodes on this one machine, for the end-to-end tests and
# for trying mover without a cloud account:
#   control plane (host processes): etcd, kube-apiserver, kube-controller-manager,
#     kube-scheduler, each with its own identity (certificates made here);
#   each node: its own network namespace (address 10.250.C.N on the bridge mover-br0,
#     pods in 10.(100+C).N.0/24 through the CNI bridge plugin) and its own mount
#     namespace (its /var/lib/kubelet, /var/lib/mover and /mnt/disks are directories of
#     this cluster, so several nodes share the machine as separate hosts would), running
#     containerd + runc, a kubelet and kube-proxy (iptables mode), all real.
#   /mnt/disks of each node is an XFS file system of its own (reflinks, as a local PV's
#   disk would have).
#
#   cluster.sh up NAME INDEX NODES     # start cluster NAME (INDEX 1..9 picks its addresses)
#   cluster.sh import NAME ARCHIVE...  # load OCI image archives into every node's containerd
#   cluster.sh stop NAME               # kill all its processes (a site losing power), keep its state
#   cluster.sh start NAME              # start a stopped cluster again over its state
#   cluster.sh apiserver NAME stop|start   # kill its API server (SIGKILL) / start it again
#   cluster.sh node NAME N stop|start  # one node losing power (every process of it
#                                      # SIGKILLed, its disks kept) / coming back
#   cluster.sh down NAME               # stop it and remove everything it made
#   cluster.sh env NAME                # print KUBECONFIG=... for a shell
#
# State under $MOVER_CLUSTERS (default /var/tmp/mover-clusters)/NAME; binaries from
# $MOVER_KUBE_BIN (deploy/test-cluster/build.sh prints it). Needs root, containerd, runc,
# containernetworking-plugins, iptables, openssl, xfsprogs (Debian packages of those
# names). Settings this machine needs and why are in deploy/test-cluster/README.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${MOVER_KUBE_BIN:-/var/tmp/mover-kube/bin}"
top="${MOVER_CLUSTERS:-/var/tmp/mover-clusters}"
bridge=mover-br0
gateway=10.250.0.1

die() { echo "cluster.sh: $*" >&2; exit 1; }

# --- certificates -----------------------------------------------------------------------
# cert NAME CN [O] [SAN]: NAME.key/NAME.crt signed by the cluster CA in $pki.
cert() {
  local name="$1" cn="$2" org="${3:-}" san="${4:-}" subj="/CN=$2" ext
  [ -z "$org" ] || subj="/O=$org/CN=$cn"
  ext="$pki/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [ -n "$san" ]; then echo "extendedKeyUsage=serverAuth,clientAuth"; echo "subjectAltName=$san"
    else echo "extendedKeyUsage=clientAuth"; fi
  } > "$ext"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "$subj" \
    -keyout "$pki/$name.key" -out "$pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 30 -extfile "$ext" -out "$pki/$name.crt" 2>/dev/null
  rm -f "$pki/$name.csr" "$ext"
}

# kubeconfig FILE CERT: a kubeconfig for client certificate CERT against the API server.
kubeconfig() {
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: $name
  cluster: {server: "https://$gateway:$api_port", certificate-authority: $pki/ca.crt}
users:
- name: $2
  user: {client-certificate: $pki/$2.crt, client-key: $pki/$2.key}
contexts:
- name: $name
  context: {cluster: $name, user: $2}
current-context: $name
EOF
}

# --- processes --------------------------------------------------------------------------
# spawn WHAT CMD...: starts CMD in the background, logs to $dir/log/WHAT.log, pid in
# $dir/pid/WHAT.
spawn() {
  local what="$1"; shift
  mkdir -p "$dir/log" "$dir/pid"
  setsid "$@" >> "$dir/log/$what.log" 2>&1 < /dev/null &
  echo $! > "$dir/pid/$what"
}

# wait_for WHAT SECONDS CMD...: until CMD succeeds.
wait_for() {
  local what="$1" secs="$2" i; shift 2
  for ((i = 0; i < secs * 5; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "cluster.sh: $what not ready within ${secs}s; last log lines:" >&2
  tail -n 20 "$dir"/log/*.log >&2 || true
  exit 1
}

kubectl_() { "$bin/kubectl" --kubeconfig "$dir/admin.kubeconfig" "$@"; }

# --- the control plane ------------------------------------------------------------------
control_plane() {
  pki="$dir/pki"; mkdir -p "$pki"
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
    -subj "/CN=$name-ca" -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  cert apiserver kube-apiserver "" \
    "IP:$gateway,IP:127.0.0.1,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
  cert admin admin system:masters
  cert apiserver-kubelet kube-apiserver-kubelet-client system:masters
  cert controller-manager system:kube-controller-manager
  cert scheduler system:kube-scheduler
  cert proxy system:kube-proxy
  openssl ecparam -name prime256v1 -genkey -noout -out "$pki/sa.key" 2>/dev/null
  openssl ec -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  for who in admin controller-manager scheduler proxy; do kubeconfig "$dir/$who.kubeconfig" "$who"; done
  start_control_plane
}

# Starts (again) the control plane's processes over what control_plane made.
start_control_plane() {
  spawn etcd "$bin/etcd" --data-dir "$dir/etcd" --unsafe-no-fsync --log-level=warn \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
    --initial-cluster "default=http://127.0.0.1:$((etcd_port + 1))"
  start_apiserver
  # Its API rate as large clusters raise it (the default, 20/s, binds a thousand
  # pre-bound PVs in about four minutes).
  spawn kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig "$dir/controller-manager.kubeconfig" --leader-elect=false --secure-port=0 \
    --use-service-account-credentials --kube-api-qps 100 --kube-api-burst 200 \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" --v=1
  spawn kube-scheduler "$bin/kube-scheduler" --kubeconfig "$dir/scheduler.kubeconfig" \
    --leader-elect=false --secure-port=0 --v=1
  wait_for "the default service account" 60 kubectl_ get serviceaccount default -n default
}

# The API server, until it is ready. Its audit log ($dir/log/audit.log) records what
# service accounts do (verb, object, answer): the tests check the controller's RBAC and
# its writes by it.
start_apiserver() {
  printf '%s\n' 'apiVersion: audit.k8s.io/v1' 'kind: Policy' 'omitStages: [RequestReceived]' \
    'rules:' '- level: Metadata' '  userGroups: ["system:serviceaccounts"]' '- level: None' \
    > "$dir/audit-policy.yaml"
  spawn kube-apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address "$gateway" --advertise-address "$gateway" --secure-port "$api_port" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --kubelet-client-certificate "$pki/apiserver-kubelet.crt" --kubelet-client-key "$pki/apiserver-kubelet.key" \
    --kubelet-preferred-address-types InternalIP \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 --service-node-port-range 30000-32767 \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --audit-policy-file "$dir/audit-policy.yaml" --audit-log-path "$dir/log/audit.log" \
    --allow-privileged=true --profiling=false --v=1
  wait_for kube-apiserver 90 kubectl_ get --raw /readyz
}

# --- a node -----------------------------------------------------------------------------
# node N: node $name-N, address 10.250.$index.N, pods 10.$((100+index)).N.0/24.
node() {
  local n="$1" node="$name-$1" ip="10.250.$index.$1" pods="10.$((100 + index)).$1.0/24"
  local nd="$dir/nodes/$node" ns="mover-$name-$1" veth="mv$index$1-$name" cg="mover-$name-$1"
  veth="${veth:0:15}"
  mkdir -p "$nd"/{kubelet,mover,disks,containerd/root,containerd/state,net.d,cni,pki,pod-logs,container-logs}
  # Network: a namespace on the shared bridge; the host routes each node's pod range.
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$bridge" up
  ip -n "$ns" addr add "$ip/16" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip -n "$ns" route add default via "$gateway"
  ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1
  ip route replace "$pods" via "$ip"
  # Disks: an XFS file system of the node's own, seen by the host at $nd/disks.
  truncate -s 8G "$nd/disks.img"
  mkfs.xfs -q -f "$nd/disks.img"
  mount -o loop "$nd/disks.img" "$nd/disks"
  # Mounts: a namespace of the node's own (host mounts propagate in, its own stay in),
  # kept by a bind of its ns file, with the node's directories over the host's paths.
  touch "$dir/ns/$node"
  unshare --mount="$dir/ns/$node" --propagation slave true
  nsenter --mount="$dir/ns/$node" -- sh -ec "
    mkdir -p /var/lib/kubelet /var/lib/mover /mnt/disks /var/lib/cni /etc/cni/net.d /var/log/pods /var/log/containers
    mount --bind '$nd/kubelet' /var/lib/kubelet
    mount --bind '$nd/mover' /var/lib/mover
    mount --rbind '$nd/disks' /mnt/disks
    mount --bind '$nd/cni' /var/lib/cni
    mount --bind '$nd/net.d' /etc/cni/net.d
    # Each kubelet removes the log directories of pods it does not know.
    mount --bind '$nd/pod-logs' /var/log/pods
    mount --bind '$nd/container-logs' /var/log/containers
    # Shared, as systemd makes every mount of a host: pods' Bidirectional and
    # HostToContainer mounts need it.
    mount --make-rshared /"
  # cgroups: the node's pods under /$cg in every hierarchy (cgroup v1 here).
  for h in /sys/fs/cgroup/*/; do
    mkdir -p "$h$cg"
    if [ -f "${h}cpuset.cpus" ]; then
      cat "${h}cpuset.cpus" > "$h$cg/cpuset.cpus"; cat "${h}cpuset.mems" > "$h$cg/cpuset.mems"
    fi
  done
  cat > "$nd/net.d/10-pods.conflist" <<EOF
{"cniVersion":"0.4.0","name":"pods","plugins":[{"type":"bridge","bridge":"cni0","isGateway":true,"ipMasq":true,
 "ipam":{"type":"host-local","ranges":[[{"subnet":"$pods"}]],"routes":[{"dst":"0.0.0.0/0"}]}},
 {"type":"portmap","capabilities":{"portMappings":true}}]}
EOF
  cat > "$nd/containerd.toml" <<EOF
version = 2
root = "$nd/containerd/root"
state = "$nd/containerd/state"
[grpc]
  address = "$nd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:1"
  # This VM lacks CAP_SYS_RESOURCE: nobody may lower oom_score_adj.
  restrict_oom_score_adj = true
  # The pods' network namespaces pinned under the node's state, not the machine's
  # /run/netns (where the pins of gone nodes would linger).
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
EOF
  # The kubelet: its own certificate (client: system:node:NAME; serving: its address).
  cert "node-$n" "system:node:$node" system:nodes
  cert "node-$n-serving" "$node" "" "IP:$ip,DNS:$node"
  kubeconfig "$nd/kubelet.kubeconfig" "node-$n"
  cat > "$nd/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupRoot: /$cg
# cgroup v1 on this machine; no swap accounting; no CAP_SYS_RESOURCE (oom_score_adj).
failCgroupV1: false
failSwapOn: false
oomScoreAdj: 0
containerRuntimeEndpoint: unix://$nd/containerd.sock
address: $ip
readOnlyPort: 0
tlsCertFile: $pki/node-$n-serving.crt
tlsPrivateKeyFile: $pki/node-$n-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
clusterDomain: cluster.local
podCIDR: $pods
# A shared machine: its disk may be fuller than a node's would be; evict nothing for it.
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# Pods' logs are kept short: the tests read them on failure.
containerLogMaxSize: 5Mi
EOF
  start_node "$n"
}

# start_node N: (again) node N's containerd, kubelet and kube-proxy, in its namespaces.
start_node() {
  local n="$1" node="$name-$1" ip="10.250.$index.$1"
  local nd="$dir/nodes/$node" ns="mover-$name-$1"
  local enter=(nsenter --mount="$dir/ns/$node" --net="/run/netns/$ns" --)
  spawn "containerd-$n" "${enter[@]}" containerd --config "$nd/containerd.toml"
  wait_for "containerd of $node" 30 ctr -a "$nd/containerd.sock" version
  spawn "kubelet-$n" "${enter[@]}" "$bin/kubelet" --config "$nd/kubelet.yaml" \
    --kubeconfig "$nd/kubelet.kubeconfig" --hostname-override "$node" --node-ip "$ip" \
    --root-dir /var/lib/kubelet --v=1
  spawn "kube-proxy-$n" "${enter[@]}" "$bin/kube-proxy" --kubeconfig "$dir/proxy.kubeconfig" \
    --hostname-override "$node" --proxy-mode iptables --cluster-cidr "10.$((100 + index)).0.0/16" \
    --conntrack-max-per-core 0 --metrics-bind-address 127.0.0.1:10249 \
    --healthz-bind-address 127.0.0.1:10256 --v=1
}

up() {
  [ $# -eq 3 ] || die "usage: cluster.sh up NAME INDEX NODES"
  name="$1" index="$2"
  local nodes="$3" n
  [[ "$index" =~ ^[1-9]$ ]] || die "INDEX is 1..9 (it picks the cluster's addresses), not '$index'"
  [ "$(id -u)" = 0 ] || die "needs root (network and mount namespaces, loop devices)"
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
    [ -x "$bin/$b" ] || die "$bin/$b is missing: run deploy/test-cluster/build.sh (MOVER_KUBE_BIN)"
  done
  for b in containerd runc ctr iptables openssl mkfs.xfs /usr/lib/cni/bridge; do
    command -v "$b" >/dev/null || die "$b is missing: apt-get install containerd runc iptables openssl xfsprogs containernetworking-plugins"
  done
  dir="$top/$name"
  [ ! -e "$dir" ] || down "$name"
  mkdir -p "$dir/ns"
  api_port=$((6440 + index)) etcd_port=$((2400 + 10 * index))
  echo "$index" > "$dir/index"
  # The ns files are binds: their directory must be a private mount.
  mount --bind "$dir/ns" "$dir/ns"; mount --make-private "$dir/ns"
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    ip link add "$bridge" type bridge
    ip addr add "$gateway/16" dev "$bridge"
    ip link set "$bridge" up
  fi
  sysctl -qw net.ipv4.ip_forward=1
  modprobe br_netfilter 2>/dev/null || true
  control_plane
  for ((n = 1; n <= nodes; n++)); do node "$n"; done
  echo "$nodes" > "$dir/nodes-count"
  nodes_ready "$nodes"
  echo "$dir/admin.kubeconfig"
}

# nodes_ready COUNT: waits until each node is Ready.
nodes_ready() {
  local n
  for ((n = 1; n <= $1; n++)); do node_ready "$n"; done
}

node_ready() {
  wait_for "node $name-$1 Ready" 120 sh -c "'$bin/kubectl' --kubeconfig '$dir/admin.kubeconfig' get node '$name-$1' -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
}

# The cluster NAME's settings, from what up wrote.
load() {
  name="$1" dir="$top/$1"
  [ -f "$dir/index" ] || die "no cluster $name in $top"
  index="$(cat "$dir/index")" pki="$dir/pki"
  api_port=$((6440 + index)) etcd_port=$((2400 + 10 * index))
}

# stop NAME: every process of the cluster killed (SIGKILL), as a site losing power
# would; its state (etcd, the nodes' disks and directories, namespaces) kept.
stop() {
  load "$1"
  kill_all
}

# start NAME: a stopped cluster's processes again, over its state.
start() {
  local n nodes
  load "$1"
  nodes="$(cat "$dir/nodes-count")"
  start_control_plane
  for ((n = 1; n <= nodes; n++)); do start_node "$n"; done
  nodes_ready "$nodes"
}

# Kills every process of the cluster in $dir: the control plane, each node's daemons
# and every container (by the node's cgroups; shims and containers outlive their
# containerd).
kill_all() {
  local pid nd
  for pid in "$dir"/pid/*; do [ -f "$pid" ] && kill -9 "$(cat "$pid")" 2>/dev/null || true; done
  for nd in "$dir"/nodes/*/; do
    [ -d "$nd" ] && kill_node_processes "$(basename "$nd")"
  done
  rm -f "$dir"/pid/*
  sleep 0.5
}

# kill_node_processes NODE: every process in NODE's cgroups and network namespace.
kill_node_processes() {
  local node="$1" h
  for h in /sys/fs/cgroup/*/"mover-$node"; do
    [ -d "$h" ] || continue
    find "$h" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  done
  ip netns pids "mover-$node" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
}

# apiserver NAME stop|start
apiserver() {
  [ $# -eq 2 ] || die "usage: cluster.sh apiserver NAME stop|start"
  load "$1"
  case "$2" in
    stop) kill -9 "$(cat "$dir/pid/kube-apiserver")" 2>/dev/null || true; rm -f "$dir/pid/kube-apiserver" ;;
    start) start_apiserver ;;
    *) die "apiserver NAME stop|start, not '$2'" ;;
  esac
}

# node NAME N stop|start: node N's kubelet, containerd, kube-proxy and containers killed
# (SIGKILL) as a node losing power, its disks and directories kept / started again
# until it is Ready (the kubelet then starts its pods again).
node_power() {
  [ $# -eq 3 ] || die "usage: cluster.sh node NAME N stop|start"
  load "$1"
  local n="$2" what
  [ -d "$dir/nodes/$name-$n" ] || die "cluster $name has no node $n"
  case "$3" in
    stop)
      for what in containerd kubelet kube-proxy; do
        kill -9 "$(cat "$dir/pid/$what-$n" 2>/dev/null)" 2>/dev/null || true
        rm -f "$dir/pid/$what-$n"
      done
      kill_node_processes "$name-$n" ;;
    start)
      start_node "$n"
      node_ready "$n" ;;
    *) die "node NAME N stop|start, not '$3'" ;;
  esac
}

import() {
  local name="$1" sock; shift
  dir="$top/$name"
  for sock in "$dir"/nodes/*/containerd.sock; do
    for archive in "$@"; do
      ctr -a "$sock" -n k8s.io image import --no-unpack "$archive" >/dev/null \
        || die "importing $archive into $sock failed"
    done
  done
}

down() {
  local name="$1" nd node ns pid h set
  dir="$top/$name"
  [ -d "$dir" ] || return 0
  kill_all
  # Loop devices over the cluster's files: the agents' over images, the hostpath
  # driver's. The kernel names their backing files as the process that attached them
  # saw them (a container's path), so they are matched by (device, inode), before the
  # files go. A kubelet holds each block volume it maps with a loop of its own over the
  # volume's device node (a lock): those go first, or the loops they hold stay.
  local ours held loop majmin ino
  ours="$(find "$dir" ! -type d -exec stat -c '%Hd:%Ld %i' {} + 2>/dev/null | sort -u)"
  held="$(losetup -nO NAME,BACK-MAJ:MIN,BACK-INO 2>/dev/null | while read -r loop majmin ino; do
    grep -qxF "$majmin $ino" <<<"$ours" && stat -c '%Hd:%Ld %i' "$loop"; done || true)"
  for set in "$held" "$ours"; do
    losetup -nO NAME,BACK-MAJ:MIN,BACK-INO 2>/dev/null | while read -r loop majmin ino; do
      grep -qxF "$majmin $ino" <<<"$set" && losetup -d "$loop" 2>/dev/null || true
    done
  done
  for nd in "$dir"/nodes/*/; do
    [ -d "$nd" ] || continue
    node="$(basename "$nd")" ns="mover-$node"
    umount "$dir/ns/$node" 2>/dev/null || true
    umount -l "$nd/disks" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
    # The host's route to the node's pods is via the bridge: it outlives the veth.
    ip route del "10.$((100 + $(cat "$dir/index"))).${node##*-}.0/24" 2>/dev/null || true
    for h in /sys/fs/cgroup/*/"mover-$node"; do
      [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
  done
  umount "$dir/ns" 2>/dev/null || true
  # Overlay mounts of containers were in the node's mount namespace, gone with it.
  rm -rf "$dir"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  import) shift; import "$@" ;;
  down) shift; down "$@" ;;
  stop) shift; stop "$@" ;;
  start) shift; start "$@" ;;
  apiserver) shift; apiserver "$@" ;;
  node) shift; node_power "$@" ;;
  env) echo "KUBECONFIG=$top/$2/admin.kubeconfig" ;;
  *) die "usage: cluster.sh up NAME INDEX NODES | import NAME ARCHIVE... | stop NAME | start NAME | apiserver NAME stop|start | node NAME N stop|start | down NAME | env NAME" ;;
esac
