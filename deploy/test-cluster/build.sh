#!/usr/bin/env bash
# Builds what the end-to-end tests run into a cache outside the clone, once:
#  - the control plane and the nodes: kube-apiserver, kube-controller-manager,
#    kube-scheduler, kubectl, kubelet and kube-proxy from k8s.io/kubernetes (kube/go.mod); etcd from go.etcd.io/etcd/server/v3 (etcd/go.mod);
#    cert-manager's CRDs;
#  - the CSI stack of issue 39 (versions: CSI_VERSIONS below, the one place they are
#    recorded; each is required by a small wrapper module under csi/, since `go install
#    mod@version` refuses every one of them for the replace directives in its go.mod, and
#    this script fails if a wrapper's go.mod says otherwise): hostpathplugin, csi-provisioner,
#    csi-snapshotter, snapshot-controller, csi-snapshot-metadata, grpcurl as the tests'
#    gRPC client, and csi-node-driver-registrar for the real nodes' agent pods (a copy of
#    its source in csi/registrar, refused by the proxy like the hostpath driver); the VolumeSnapshot* and SnapshotMetadataService CRDs into $bin/crds and
#    the CSI spec's csi.proto into $bin/proto. The Go module proxy refuses
#    csi-driver-host-path (403), so csi/hostpath is a copy of its source at its tag (see
#    csi/hostpath/README.md).
#  - csi-sanity, the CSI conformance tests (github.com/kubernetes-csi/csi-test/v5, its
#    cmd/csi-sanity), run against the driver's socket: version CSI_SANITY below, required by
#    the wrapper module sanity/ (outside csi/, so that the CSI stack's stamp does not cover
#    it; this script fails if its go.mod says otherwise).
# Each part has its own stamp (its inputs, its function below and the Go version), so a
# change to one part does not rebuild the other.
#
#   deploy/test-cluster/build.sh            # prints the bin directory
#   MOVER_KUBE_CACHE=/somewhere build.sh    # default /var/tmp/mover-kube
#
# Needs Go >= 1.26 and the Go module proxy. A cold build of the control plane takes about
# 15-25 minutes on two cores; of the CSI stack about 14 more (measured: 13m56s, on two
# cores shared with a cargo build, the modules already downloaded; downloading them took
# under a minute); of csi-sanity about 1.5 more (measured: 1m21s, its modules downloaded).
# Later runs take a second.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${MOVER_KUBE_CACHE:-/var/tmp/mover-kube}"
bin="$cache/bin"
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "build.sh: Go (>= 1.26) is needed to build the test control plane" >&2; exit 1; }
CERT_MANAGER=v1.19.1
# wrapper dir, module, version (the tag the binaries report).
CSI_VERSIONS="
hostpath          github.com/kubernetes-csi/csi-driver-host-path                   v1.18.0
provisioner       github.com/kubernetes-csi/external-provisioner/v6                v6.4.0
snapshotter       github.com/kubernetes-csi/external-snapshotter/v8                v8.7.0
snapshotter       github.com/kubernetes-csi/external-snapshotter/client/v8         v8.7.0
snapshot-metadata github.com/kubernetes-csi/external-snapshot-metadata             v1.1.0
snapshot-metadata github.com/kubernetes-csi/external-snapshot-metadata/client      v1.0.0
grpcurl           github.com/fullstorydev/grpcurl                                  v1.9.4
registrar         github.com/kubernetes-csi/node-driver-registrar                  v2.15.0
"
# module, version of csi-sanity (wrapper dir sanity/).
CSI_SANITY="github.com/kubernetes-csi/csi-test/v5 v5.6.0"
export GOFLAGS=-mod=mod CGO_ENABLED=0

# The version CSI_VERSIONS gives module $1.
csi_version() { awk -v m="$1" '$2 == m {print $3}' <<<"$CSI_VERSIONS"; }

# The directory of module $2 as resolved by the module in $here/$1.
module_dir() { (cd "$here/csi/$1" && go list -m -f '{{.Dir}}' "$2"); }

control_plane() {
  local k8s_version minor v ldflags cmd cm
  k8s_version="$(awk '/^require k8s.io\/kubernetes/ {print $3}' "$here/kube/go.mod")"
  minor="${k8s_version#v1.}"; minor="${minor%%.*}"
  # The version the binaries report (and the API server emulates): without it they say
  # v0.0.0-master.
  v=k8s.io/component-base/version
  ldflags="-s -w -X $v.gitVersion=$k8s_version -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z"
  cd "$here/kube"
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
    echo "build.sh: building $cmd $k8s_version" >&2
    go build -trimpath -ldflags "$ldflags" -o "$bin/$cmd" "k8s.io/kubernetes/cmd/$cmd"
  done
  cd "$here/etcd"
  echo "build.sh: building etcd" >&2
  go build -trimpath -ldflags "-s -w" -o "$bin/etcd" .
  # cert-manager's CRDs (plain YAML in its Go module), so the mtls overlay's Certificates
  # and Issuers can be applied; cert-manager itself does not run here.
  mkdir -p "$bin/crds"
  cm="$(go mod download -json "github.com/cert-manager/cert-manager@$CERT_MANAGER" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
  cp "$cm"/deploy/crds/cert-manager.io_*.yaml "$bin/crds/"
}

csi_stack() {
  local dir mod ver pinned hostpath provisioner snapshotter metadata grpcurl registrar
  # Each wrapper's go.mod must pin what CSI_VERSIONS says.
  while read -r dir mod ver; do
    [ -n "$dir" ] || continue
    if [ "$dir" = hostpath ] || [ "$dir" = registrar ]; then  # copies of their source
      pinned="$(awk '/^module / {print $2}' "$here/csi/$dir/go.mod") $(cat "$here/csi/$dir/VERSION")"
    else
      pinned="$(cd "$here/csi/$dir" && go list -m -f '{{.Path}} {{.Version}}' "$mod")"
    fi
    [ "$pinned" = "$mod $ver" ] || { echo "build.sh: csi/$dir pins '$pinned', CSI_VERSIONS says '$mod $ver'" >&2; exit 1; }
  done <<<"$CSI_VERSIONS"
  hostpath="$(csi_version github.com/kubernetes-csi/csi-driver-host-path)"
  provisioner="$(csi_version github.com/kubernetes-csi/external-provisioner/v6)"
  snapshotter="$(csi_version github.com/kubernetes-csi/external-snapshotter/v8)"
  metadata="$(csi_version github.com/kubernetes-csi/external-snapshot-metadata)"
  grpcurl="$(csi_version github.com/fullstorydev/grpcurl)"
  registrar="$(csi_version github.com/kubernetes-csi/node-driver-registrar)"
  echo "build.sh: building hostpathplugin $hostpath" >&2
  (cd "$here/csi/hostpath" && go build -trimpath -ldflags "-s -w -X main.version=$hostpath" -o "$bin/hostpathplugin" ./cmd/hostpathplugin)
  echo "build.sh: building csi-provisioner $provisioner" >&2
  (cd "$here/csi/provisioner" && go build -trimpath -ldflags "-s -w -X main.version=$provisioner" -o "$bin/csi-provisioner" github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner)
  for cmd in csi-snapshotter snapshot-controller; do
    echo "build.sh: building $cmd $snapshotter" >&2
    (cd "$here/csi/snapshotter" && go build -trimpath -ldflags "-s -w -X main.version=$snapshotter" -o "$bin/$cmd" "github.com/kubernetes-csi/external-snapshotter/v8/cmd/$cmd")
  done
  echo "build.sh: building csi-snapshot-metadata $metadata" >&2
  (cd "$here/csi/snapshot-metadata" && go build -trimpath -ldflags "-s -w -X main.version=$metadata" -o "$bin/csi-snapshot-metadata" github.com/kubernetes-csi/external-snapshot-metadata/cmd/csi-snapshot-metadata)
  echo "build.sh: building grpcurl $grpcurl" >&2
  (cd "$here/csi/grpcurl" && go build -trimpath -ldflags "-s -w -X main.version=$grpcurl" -o "$bin/grpcurl" github.com/fullstorydev/grpcurl/cmd/grpcurl)
  echo "build.sh: building csi-node-driver-registrar $registrar" >&2
  (cd "$here/csi/registrar" && go build -trimpath -ldflags "-s -w -X main.version=$registrar" -o "$bin/csi-node-driver-registrar" ./cmd/csi-node-driver-registrar)
  mkdir -p "$bin/crds" "$bin/proto"
  cp "$(module_dir snapshotter github.com/kubernetes-csi/external-snapshotter/client/v8)"/config/crd/snapshot.storage.k8s.io_volumesnapshot*.yaml "$bin/crds/"
  cp "$(module_dir snapshot-metadata github.com/kubernetes-csi/external-snapshot-metadata/client)"/config/crd/cbt.storage.k8s.io_snapshotmetadataservices.yaml "$bin/crds/"
  # The CSI spec the driver was built against, for grpcurl's calls on its socket.
  cp "$(module_dir hostpath github.com/container-storage-interface/spec)/csi.proto" "$bin/proto/csi.proto"
  chmod u+w "$bin"/crds/* "$bin"/proto/*
}

csi_sanity() {
  local pinned
  pinned="$(cd "$here/sanity" && go list -m -f '{{.Path}} {{.Version}}' "${CSI_SANITY%% *}")"
  [ "$pinned" = "$CSI_SANITY" ] || { echo "build.sh: sanity pins '$pinned', CSI_SANITY says '$CSI_SANITY'" >&2; exit 1; }
  echo "build.sh: building csi-sanity ${CSI_SANITY#* }" >&2
  (cd "$here/sanity" && go build -trimpath -ldflags "-s -w -X main.VERSION=${CSI_SANITY#* }" -o "$bin/csi-sanity" github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity)
}

# Builds part $1 (a function above) unless its stamp file $2 holds the hash of its inputs:
# the text $3 (versions, helpers), the files $4..., the function's own text and the Go
# version.
build_part() {
  local part="$1" stampfile="$bin/$2" text="$3" stamp
  shift 3
  stamp="$( (echo "$text"; cat "$@"; declare -f "$part"; go version) | sha256sum | cut -c1-16)"
  if [ -f "$stampfile" ] && [ "$(cat "$stampfile")" = "$stamp" ]; then
    return
  fi
  mkdir -p "$bin"
  rm -f "$stampfile"
  # Not in an && list: set -e must hold inside the function.
  (cd "$here"; "$part")
  echo "$stamp" > "$stampfile"
}

build_part control_plane .stamp "$CERT_MANAGER" "$here"/kube/go.mod "$here"/kube/go.sum "$here"/etcd/go.mod "$here"/etcd/go.sum "$here"/etcd/main.go
build_part csi_stack .stamp-csi "$CSI_VERSIONS$(declare -f csi_version module_dir)" $(find "$here/csi" -type f | LC_ALL=C sort)
build_part csi_sanity .stamp-sanity "$CSI_SANITY" $(find "$here/sanity" -type f | LC_ALL=C sort)
echo "$bin"
