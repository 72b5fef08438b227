//go:build !linux

package gateway

import "time"

// threadCPU is unavailable here; benchmarks then report 0 cpu-µs.
func threadCPU() time.Duration { return 0 }
