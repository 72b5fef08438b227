//go:build unix

package enginesim

import (
	"syscall"
	"time"
)

// processCPU is the CPU time (user + system) this process has used: unlike
// wall time it barely moves when other processes crowd the machine.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
