//go:build !unix

package enginesim

import "time"

func processCPU() time.Duration { return 0 }
