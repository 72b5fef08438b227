//go:build unix

package chattemplate

import (
	"syscall"
	"time"
)

// processCPU is the CPU time this process has used (user + system). The
// benchmarks report it per op because the shared test machine is often
// oversubscribed, which inflates wall-clock ns/op but not CPU time.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
