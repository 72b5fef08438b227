package gateway

import (
	"time"

	"golang.org/x/sys/unix"
)

// threadCPU is the CPU time the calling OS thread has used: unlike wall
// time it does not count waiting for a core the other tenants hold.
func threadCPU() time.Duration {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// threadFaults is how many page faults the calling OS thread has taken.
func threadFaults() int64 {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_THREAD, &ru) != nil {
		return 0
	}
	return ru.Minflt + ru.Majflt
}

// touchFreshPages maps n fresh pages and writes a byte into each; it
// reports the time the writes took.
func touchFreshPages(n int) (time.Duration, error) {
	page := unix.Getpagesize()
	b, err := unix.Mmap(-1, 0, n*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return 0, err
	}
	defer unix.Munmap(b)
	t := time.Now()
	for i := 0; i < len(b); i += page {
		b[i] = 1
	}
	return time.Since(t), nil
}
