//go:build tools

// Package tools names the commands ../../build.sh builds from github.com/kubernetes-csi/external-snapshot-metadata@v1.1.0, so
// `go mod tidy` keeps their dependencies.
package tools

import (
	_ "github.com/kubernetes-csi/external-snapshot-metadata/cmd/csi-snapshot-metadata"
)
