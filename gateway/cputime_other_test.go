//go:build !linux

package gateway

import (
	"errors"
	"time"
)

// threadCPU and threadFaults are unavailable here; benchmarks then report 0.
func threadCPU() time.Duration { return 0 }
func threadFaults() int64      { return 0 }

func touchFreshPages(int) (time.Duration, error) { return 0, errors.ErrUnsupported }
