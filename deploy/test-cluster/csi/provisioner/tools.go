//go:build tools

// Package tools names the commands ../../build.sh builds from github.com/kubernetes-csi/external-provisioner/v6@v6.4.0, so
// `go mod tidy` keeps their dependencies.
package tools

import (
	_ "github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner"
)
