#!/usr/bin/env bash
# Deploys the hostpath CSI driver and the CSI snapshot stack (./kustomization.yaml) on
# test cluster NAME (../cluster.sh up NAME ...), as pods:
#   1. imports the images (./images.sh's, and ../images.sh's pause and registrar) into
#      every node's containerd with cluster.sh import;
#   2. applies the VolumeSnapshot* and SnapshotMetadataService CRDs from
#      $MOVER_KUBE_BIN/crds (build.sh copies them there from their Go modules);
#   3. makes csi-snapshot-metadata's serving certificate (a CA of its own and a
#      certificate for the sidecar's Service) as the Secret csi-snapshot-metadata-certs,
#      once per cluster (kept when it exists);
#   4. applies the kustomization through an overlay that pins the driver to node NAME-1
#      and puts the CA into the SnapshotMetadataService;
#   5. waits until the driver's pod and the snapshot-controller's pods are Ready.
# Prints nothing on success; can be run again.
#
#   deploy/test-cluster/csi-hostpath/up.sh NAME
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${MOVER_KUBE_BIN:-/var/tmp/mover-kube/bin}"
top="${MOVER_CLUSTERS:-/var/tmp/mover-clusters}"
die() { echo "csi-hostpath/up.sh: $*" >&2; exit 1; }
[ $# -eq 1 ] || die "usage: up.sh NAME"
name="$1"
kubeconfig="$top/$name/admin.kubeconfig"
[ -f "$kubeconfig" ] || die "no cluster $name ($kubeconfig): start it with deploy/test-cluster/cluster.sh up"
k() { "$bin/kubectl" --kubeconfig "$kubeconfig" "$@"; }
ns=csi-hostpath
# The sidecar's Service address (hostpath/csi-snapshot-metadata-service.yaml).
service_ip=10.96.0.100
# The clusters' bridge address on the host (cluster.sh): the certificate names it too, so
# a test may put a fault-injecting proxy there between the controller and the sidecar.
gateway=10.250.0.1

# 1. Images.
archives=("$bin/images/pause.oci.tar" "$bin/images/csi-node-driver-registrar.oci.tar")
for i in hostpathplugin csi-provisioner csi-snapshotter snapshot-controller csi-snapshot-metadata; do
  archives+=("$bin/images/csi-hostpath-$i.oci.tar")
done
for a in "${archives[@]}"; do
  [ -f "$a" ] || die "$a is missing: run deploy/test-cluster/images.sh and deploy/test-cluster/csi-hostpath/images.sh"
done
"$here/../cluster.sh" import "$name" "${archives[@]}"

# 2. CRDs.
crds=(snapshot.storage.k8s.io_volumesnapshotclasses snapshot.storage.k8s.io_volumesnapshotcontents
  snapshot.storage.k8s.io_volumesnapshots cbt.storage.k8s.io_snapshotmetadataservices)
for c in "${crds[@]}"; do
  k apply --server-side --force-conflicts -f "$bin/crds/$c.yaml" >/dev/null
done
k wait --for=condition=Established --timeout=60s crd/volumesnapshotclasses.snapshot.storage.k8s.io \
  crd/volumesnapshotcontents.snapshot.storage.k8s.io crd/volumesnapshots.snapshot.storage.k8s.io \
  crd/snapshotmetadataservices.cbt.storage.k8s.io >/dev/null

# 3 and 4: an overlay in a temporary directory (kustomize reads no files outside its
# root, but takes another kustomization's directory from anywhere, by a relative path).
overlay="$(mktemp -d)"
trap 'rm -rf "$overlay"' EXIT
if k get namespace "$ns" >/dev/null 2>&1 && k -n "$ns" get secret csi-snapshot-metadata-certs >/dev/null 2>&1; then
  for f in tls.crt tls.key ca.crt; do
    k -n "$ns" get secret csi-snapshot-metadata-certs -o "jsonpath={.data.${f//./\\.}}" | base64 -d > "$overlay/$f"
  done
else
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 365 \
    -subj "/CN=csi-snapshot-metadata-ca" -keyout "$overlay/ca.key" -out "$overlay/ca.crt" 2>/dev/null
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=csi-snapshot-metadata.$ns" -keyout "$overlay/tls.key" -out "$overlay/tls.csr" 2>/dev/null
  svc="csi-snapshot-metadata.$ns"
  cat > "$overlay/tls.ext" <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$service_ip,IP:$gateway,DNS:csi-snapshot-metadata,DNS:$svc,DNS:$svc.svc,DNS:$svc.svc.cluster.local
EOF
  openssl x509 -req -in "$overlay/tls.csr" -CA "$overlay/ca.crt" -CAkey "$overlay/ca.key" \
    -CAcreateserial -days 365 -extfile "$overlay/tls.ext" -out "$overlay/tls.crt" 2>/dev/null
  rm -f "$overlay/ca.key" "$overlay/ca.srl" "$overlay/tls.csr" "$overlay/tls.ext"
fi
cat > "$overlay/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(realpath --relative-to="$overlay" "$here")
secretGenerator:
  - name: csi-snapshot-metadata-certs
    namespace: $ns
    type: kubernetes.io/tls
    files: [tls.crt, tls.key, ca.crt]
    options: {disableNameSuffixHash: true}
patches:
  - target: {kind: StatefulSet, name: csi-hostpathplugin}
    patch: |
      - op: replace
        path: /spec/template/spec/nodeSelector/kubernetes.io~1hostname
        value: $name-1
  - target: {kind: SnapshotMetadataService, name: hostpath.csi.k8s.io}
    patch: |
      - op: replace
        path: /spec/caCert
        value: $(base64 -w0 < "$overlay/ca.crt")
EOF
k apply -k "$overlay" >/dev/null

# 5. Ready.
k -n "$ns" rollout status statefulset/csi-hostpathplugin --timeout=180s >/dev/null \
  || die "the driver's pod is not Ready: $(k -n "$ns" describe pod csi-hostpathplugin-0 | tail -n 20)"
# Its 2 replicas Ready (not Available: that takes upstream's minReadySeconds, 35 s, more).
k -n kube-system wait --for=jsonpath='{.status.readyReplicas}'=2 deployment/snapshot-controller --timeout=120s >/dev/null \
  || die "snapshot-controller is not Ready: $(k -n kube-system get pods -l app.kubernetes.io/name=snapshot-controller)"
