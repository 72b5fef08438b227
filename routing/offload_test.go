package routing

import (
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/costfit"
)

// The offloaded part of a match shrinks first when the match is cut short
// and does not grow when it is extended; its load is priced per medium, at
// most at the prefill cost.
func TestOffloadedPartAndPrice(t *testing.T) {
	c := Candidate{PrefixAware: true, MatchedTokens: 96, OffloadedTokens: 64, OffloadMedium: "CPU"}
	for _, tc := range []struct{ matched, want int }{{96, 64}, {64, 32}, {32, 0}, {0, 0}, {160, 64}} {
		if got := offloaded(&c, tc.matched); got != tc.want {
			t.Errorf("offloaded of %d matched = %d, want %d", tc.matched, got, tc.want)
		}
	}
	if got := offloaded(&Candidate{MatchedTokens: 96, OffloadedTokens: 64}, 96); got != 0 {
		t.Errorf("a candidate not prefix-aware has %d offloaded", got)
	}
	k := costfit.Coefficients{PerToken: 30 * time.Microsecond}
	cfg := Config{OffloadPerTokenBy: map[string]time.Duration{"DISK": 40 * time.Microsecond}}.withDefaults()
	for _, tc := range []struct {
		medium string
		want   time.Duration
	}{{"CPU", 2600 * time.Nanosecond}, {"DISK", 30 * time.Microsecond}, {"", 2600 * time.Nanosecond}} {
		if got := cfg.offloadCost(&k, tc.medium); got != tc.want {
			t.Errorf("load cost on %q = %v, want %v", tc.medium, got, tc.want)
		}
	}
	if got := cfg.loadTime(&k, &c, 96); got != 64*2600*time.Nanosecond {
		t.Errorf("load time %v", got)
	}
	if err := (Config{OffloadPerToken: -1}).withDefaults().check(); err == nil {
		t.Error("a negative load cost accepted")
	}
}
