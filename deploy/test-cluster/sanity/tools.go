//go:build tools

// Package tools names the command ../build.sh builds from
// github.com/kubernetes-csi/csi-test/v5@v5.6.0 (csi-sanity, the CSI conformance tests run
// against the driver's socket), so `go mod tidy` keeps its dependencies.
package tools

import (
	_ "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity"
)
