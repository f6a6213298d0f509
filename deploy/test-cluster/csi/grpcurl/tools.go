//go:build tools

// Package tools names the commands ../../build.sh builds from github.com/fullstorydev/grpcurl@v1.9.4, so
// `go mod tidy` keeps their dependencies.
package tools

import (
	_ "github.com/fullstorydev/grpcurl/cmd/grpcurl"
)
