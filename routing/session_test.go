package routing

import (
	"testing"
)

// sessionHome is the replica kvaware places session s on in an idle fleet
// of n: the one every router agrees on.
func sessionHome(t *testing.T, s uint64, n int) int {
	t.Helper()
	d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 64, BlockSize: 16, Session: s, Now: t0}, fleetOf(n))
	if !d.SessionHome {
		t.Fatalf("idle fleet: session %d not on its home: %+v", s, d)
	}
	return d.Pick
}

func TestSessionsSpreadAndRoutersAgree(t *testing.T) {
	homes := map[int]int{}
	for s := uint64(1); s <= 400; s++ {
		h := sessionHome(t, s, 8)
		homes[h]++
		// A second router (another policy instance) and another affinity
		// key (another prompt) agree.
		d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 64, AffinityKey: s * 977, Session: s, Now: t0}, fleetOf(8))
		if d.Pick != h || d.Mode != ModeCold {
			t.Fatalf("session %d: home %d, then %d (%s)", s, h, d.Pick, d.Mode)
		}
	}
	for r := range 8 {
		if homes[r] < 25 || homes[r] > 75 { // 50 expected
			t.Fatalf("homes spread %v", homes)
		}
	}
}

func TestEstablishedSessionStaysHomeWithinTheSlackOnly(t *testing.T) {
	const s = 42
	h := sessionHome(t, s, 4)
	other := (h + 1) % 4
	kv := mustPolicy(t, "kvaware")
	for _, c := range []struct {
		name        string
		homeQueued  int // prefill tokens queued at the home (30 µs each)
		otherCached int // tokens of the prompt another replica holds
		wantHome    bool
	}{
		{"tie", 0, 0, true},
		{"another holds 512 tokens (15 ms saved)", 0, 512, true},
		{"home's queue 40 ms longer", 1333, 0, true},
		{"home's queue 90 ms longer", 3000, 0, false},
		{"another holds 4,096 tokens (123 ms saved)", 0, 4096, false},
	} {
		cands := fleetOf(4)
		cands[h].PendingPrefillTokens = c.homeQueued
		cands[other].MatchedTokens = c.otherCached
		d := route(t, kv, &Request{PromptTokens: 8192, BlockSize: 16, Session: s, Now: t0}, cands)
		if (d.Pick == h) != c.wantHome || d.SessionHome != c.wantHome {
			t.Errorf("%s: pick %d (home %d) session_home=%v, want home=%v; %s", c.name, d.Pick, h, d.SessionHome, c.wantHome, d.Reason)
		}
		if c.otherCached > 0 && d.Pick == other && d.Mode != ModePrefix || c.otherCached > 0 && d.Pick == h && d.Mode != ModeBalance {
			t.Errorf("%s: mode %s at %d", c.name, d.Mode, d.Pick)
		}
	}
}

func TestSessionHomeIsNeverALoadOnlyReplica(t *testing.T) {
	cands := fleetOf(3)
	for i := range cands {
		cands[i].PrefixAware = false
	}
	d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 64, Session: 7, Now: t0}, cands)
	if d.SessionHome {
		t.Fatalf("placed on a load-only home: %+v", d)
	}
}
