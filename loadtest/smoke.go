package loadtest

import (
	"time"

	"github.com/kvmesh/kvmesh/loadtest/workload"
)

// SmokeParams is a tenants workload small enough for a test run: a few
// groups with short contexts at a modest rate.
var SmokeParams = workload.TenantsParams{
	Groups: 4, UsersPerGroup: 2, ContextTokens: 600, QuestionTokens: 120, OutputTokens: 8,
	RateStart: 20, RateEnd: 40,
}

// Smoke is the scenario of --smoke and of the package's cluster test:
// 2 replicas and 2 routers, ~3 s of arrivals, at most 80 requests.
var Smoke = Scenario{
	Name: "smoke", About: "4 groups × 600-token context, 2 users each, 20→40 req/s",
	Replicas: 2, TimeScale: 0.2, Duration: 600 * time.Millisecond, FleetFill: 0.7, MinKVBlocks: 2048,
	Policies: []string{"round-robin", "kvaware"},
	Generate: func(seed uint64, d time.Duration) (workload.Workload, error) {
		return workload.Tenants("smoke", SmokeParams, seed, d)
	},
}

// SmokeMaxRequests bounds a smoke run.
const SmokeMaxRequests = 80
