//go:build tools

// Package tools names the commands ../../build.sh builds from github.com/kubernetes-csi/external-snapshotter/v8@v8.7.0, so
// `go mod tidy` keeps their dependencies.
package tools

import (
	_ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter"
	_ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller"
)
