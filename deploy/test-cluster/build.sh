#!/usr/bin/env bash
# Builds the control plane the end-to-end tests run (kube-apiserver,
# kube-controller-manager, kubectl from k8s.io/kubernetes; etcd from
# go.etcd.io/etcd/server/v3) into a cache outside the clone, once: a stamp of the go.mod
# files and the Go version says whether the binaries there are current.
#
#   deploy/test-cluster/build.sh            # prints the bin directory
#   MOVER_KUBE_CACHE=/somewhere build.sh    # default /var/tmp/mover-kube
#
# Needs Go >= 1.26 and the Go module proxy. A cold build takes about 15-25 minutes on
# two cores; later runs take a second.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${MOVER_KUBE_CACHE:-/var/tmp/mover-kube}"
bin="$cache/bin"
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "build.sh: Go (>= 1.26) is needed to build the test control plane" >&2; exit 1; }
CERT_MANAGER=v1.19.1
k8s_version="$(awk '/^require k8s.io\/kubernetes/ {print $3}' "$here/kube/go.mod")"
stamp="$( (cat "$here"/kube/go.mod "$here"/kube/go.sum "$here"/etcd/go.mod "$here"/etcd/go.sum "$here"/etcd/main.go "$0"; go version) | sha256sum | cut -c1-16)"
if [ -f "$bin/.stamp" ] && [ "$(cat "$bin/.stamp")" = "$stamp" ]; then
  echo "$bin"; exit 0
fi
mkdir -p "$bin"
rm -f "$bin/.stamp"
export GOFLAGS=-mod=mod CGO_ENABLED=0
minor="${k8s_version#v1.}"; minor="${minor%%.*}"
# The version the binaries report (and the API server emulates): without it they say
# v0.0.0-master.
v=k8s.io/component-base/version
ldflags="-s -w -X $v.gitVersion=$k8s_version -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z"
cd "$here/kube"
for cmd in kube-apiserver kube-controller-manager kubectl; do
  echo "build.sh: building $cmd $k8s_version" >&2
  go build -trimpath -ldflags "$ldflags" -o "$bin/$cmd" "k8s.io/kubernetes/cmd/$cmd"
done
cd "$here/etcd"
echo "build.sh: building etcd" >&2
go build -trimpath -ldflags "-s -w" -o "$bin/etcd" .
# cert-manager's CRDs (plain YAML in its Go module), so the mtls overlay's Certificates
# and Issuers can be applied; cert-manager itself does not run here.
crds="$bin/crds"
mkdir -p "$crds"
cm="$(go mod download -json "github.com/cert-manager/cert-manager@$CERT_MANAGER" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
cp "$cm"/deploy/crds/cert-manager.io_*.yaml "$crds/"
echo "$stamp" > "$bin/.stamp"
echo "$bin"
