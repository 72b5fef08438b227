package quota

import (
	"math/rand/v2"
	"sort"
	"strconv"
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)

var oneRequest = Usage{Requests: 1}

func TestOneRouterAdmitsItsLimitAMinute(t *testing.T) {
	l := New(Config{PeerTTL: 2 * time.Second})
	lim := Limits{RequestsPerMinute: 100}
	admitted := 0
	now := t0
	for i := 0; i < 300; i++ {
		now = t0.Add(time.Duration(i) * 100 * time.Millisecond) // 10 a second, 30 s
		if v := l.Admit("a", lim, oneRequest, now); v.OK {
			l.Charge("a", oneRequest, now)
			admitted++
		} else if v.RetryAfter < time.Second || v.RetryAfter > time.Minute || v.Isolated {
			t.Fatalf("refusal %+v", v)
		}
	}
	if admitted != 100 {
		t.Fatalf("admitted %d of 300 in 30 s, limit 100/min", admitted)
	}
	// The first second's usage leaves the window a minute on.
	if v := l.Admit("a", lim, oneRequest, t0.Add(59*time.Second)); v.OK {
		t.Fatal("admitted before the window moved")
	}
	if v := l.Admit("a", lim, oneRequest, t0.Add(60*time.Second)); !v.OK {
		t.Fatal("refused once the first second's requests left the window")
	}
	if v := l.Admit("b", lim, oneRequest, now); !v.OK {
		t.Fatal("another tenant refused")
	}
	if v := l.Admit("c", Limits{}, Usage{Requests: 1 << 40}, now); !v.OK {
		t.Fatal("no limits refused")
	}
}

func TestTokensChargedThenCorrected(t *testing.T) {
	l := New(Config{PeerTTL: 2 * time.Second})
	lim := Limits{TokensPerMinute: 10000}
	est := Usage{Requests: 1, Tokens: 4000} // prompt + max_tokens
	for i := 0; i < 2; i++ {
		if !l.Admit("a", lim, est, t0).OK {
			t.Fatalf("estimate %d refused", i)
		}
		l.Charge("a", est, t0)
	}
	if l.Admit("a", lim, est, t0).OK {
		t.Fatal("a third estimate fits 10,000 tokens")
	}
	// The answers used 1,000 tokens each, not 4,000: the rest comes back.
	l.Charge("a", Usage{Tokens: -3000}, t0)
	l.Charge("a", Usage{Tokens: -3000}, t0)
	if !l.Admit("a", lim, est, t0).OK {
		t.Fatal("refused after the correction")
	}
}

// fleet simulates routers exchanging reports every interval, each delivered
// lag later, and counts what the cluster admitted.
type fleet struct {
	routers  []*Ledger
	pending  []delivery
	admitted []time.Time
	interval time.Duration
	lag      time.Duration
	next     time.Time
}

type delivery struct {
	at       time.Time
	from, to int
	usage    []TenantUsage
}

func newFleet(n int, interval, lag time.Duration) *fleet {
	f := &fleet{interval: interval, lag: lag, next: t0}
	for range n {
		f.routers = append(f.routers, New(Config{PeerTTL: 3*interval + lag, MaxLag: lag}))
	}
	return f
}

func (f *fleet) tick(now time.Time, cut func(from, to int) bool) {
	for now.After(f.next) || now.Equal(f.next) {
		for i, r := range f.routers {
			rep := r.Report(f.next, nil)
			for j := range f.routers {
				if j != i && (cut == nil || !cut(i, j)) {
					f.pending = append(f.pending, delivery{at: f.next.Add(f.lag), from: i, to: j, usage: rep})
				}
			}
		}
		f.next = f.next.Add(f.interval)
	}
	kept := f.pending[:0]
	for _, d := range f.pending {
		if d.at.After(now) {
			kept = append(kept, d)
			continue
		}
		f.routers[d.to].Merge("r"+strconv.Itoa(d.from), d.at, d.usage)
	}
	f.pending = kept
}

func (f *fleet) offer(i int, lim Limits, now time.Time) {
	if f.routers[i].Admit("t", lim, oneRequest, now).OK {
		f.routers[i].Charge("t", oneRequest, now)
		f.admitted = append(f.admitted, now)
	}
}

// worstMinute is the most requests admitted in any minute.
func (f *fleet) worstMinute() int {
	sort.Slice(f.admitted, func(i, j int) bool { return f.admitted[i].Before(f.admitted[j]) })
	worst, j := 0, 0
	for i := range f.admitted {
		for f.admitted[i].Sub(f.admitted[j]) >= time.Minute {
			j++
		}
		worst = max(worst, i-j+1)
	}
	return worst
}

const step = 10 * time.Millisecond

// Four routers, reports every 500 ms arriving 500 ms late, the tenant
// sending several times its limit: steady, in a burst through all routers
// at once, and through one router only.
func TestFourRoutersOvershootByAtMostTenPercent(t *testing.T) {
	lim := Limits{RequestsPerMinute: 600}
	for _, tc := range []struct {
		name  string
		offer func(rng *rand.Rand, now time.Time) []int // routers offered a request now
		least float64                                   // of the limit, in the worst minute
	}{
		{"steady 3x, spread", func(rng *rand.Rand, now time.Time) []int {
			if rng.IntN(100) < 30 { // 30 req/s = 3× 600/min
				return []int{rng.IntN(4)}
			}
			return nil
		}, 0.9},
		{"burst through every router", func(rng *rand.Rand, now time.Time) []int {
			if now.Sub(t0) < 2*time.Second {
				return []int{0, 1, 2, 3, 0, 1, 2, 3} // 3,200 requests in 2 s
			}
			return nil
		}, 0.9},
		{"one router takes it all", func(rng *rand.Rand, now time.Time) []int {
			if rng.IntN(100) < 30 {
				return []int{2}
			}
			return nil
		}, 0.9},
		// Router 1 looked once (reserving its share) and went idle: the
		// share it held comes back within a TTL.
		{"one router takes it all after another looked", func(rng *rand.Rand, now time.Time) []int {
			if now.Equal(t0) {
				return []int{1}
			}
			if rng.IntN(100) < 30 {
				return []int{2}
			}
			return nil
		}, 0.9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFleet(4, 500*time.Millisecond, 500*time.Millisecond)
			rng := rand.New(rand.NewPCG(7, 7))
			// Let the routers hear of each other first.
			for now := t0; now.Before(t0.Add(2 * time.Second)); now = now.Add(step) {
				f.tick(now, nil)
			}
			start := t0.Add(2 * time.Second)
			for now := start; now.Before(start.Add(3 * time.Minute)); now = now.Add(step) {
				f.tick(now, nil)
				for _, i := range tc.offer(rng, now.Add(-2*time.Second)) {
					f.offer(i, lim, now)
				}
			}
			worst := f.worstMinute()
			t.Logf("worst minute %d admitted, limit %d (%.1f %%)", worst, lim.RequestsPerMinute, 100*float64(worst)/float64(lim.RequestsPerMinute))
			if float64(worst) > 1.10*float64(lim.RequestsPerMinute) {
				t.Fatalf("worst minute %d admitted, over 110 %% of %d", worst, lim.RequestsPerMinute)
			}
			if float64(worst) < tc.least*float64(lim.RequestsPerMinute) {
				t.Fatalf("worst minute only %d admitted of %d: the limit is not reachable", worst, lim.RequestsPerMinute)
			}
		})
	}
}

// A router cut off from the others keeps to its share, says so, and takes
// the whole limit again only once the others left on purpose.
func TestCutOffRouterKeepsToItsShare(t *testing.T) {
	lim := Limits{RequestsPerMinute: 400}
	f := newFleet(4, 500*time.Millisecond, 100*time.Millisecond)
	for now := t0; now.Before(t0.Add(2 * time.Second)); now = now.Add(step) {
		f.tick(now, nil)
	}
	isolated := func(from, to int) bool { return from != 0 || to == 0 }
	start := t0.Add(2 * time.Second)
	r0 := f.routers[0]
	sawIsolated := false
	for now := start; now.Before(start.Add(time.Minute)); now = now.Add(step) {
		f.tick(now, isolated) // router 0 hears nobody from now on
		f.offer(0, lim, now)  // 100 a second, all to router 0
		sawIsolated = sawIsolated || r0.Isolated(now)
	}
	if !sawIsolated {
		t.Fatal("never isolated")
	}
	if n := f.worstMinute(); n > 110 || n < 90 {
		t.Fatalf("cut off, admitted %d in a minute; its share of 400 over 4 routers is 100", n)
	}
	now := start.Add(time.Minute)
	for i := 1; i < 4; i++ {
		r0.Left("r" + strconv.Itoa(i))
	}
	if r0.Isolated(now) {
		t.Fatal("isolated after the others left")
	}
	if v := r0.Admit("t", lim, Usage{Requests: 150}, now); !v.OK {
		t.Fatalf("alone, refused 150 of a 400 limit with ~100 used: %+v", v)
	}
}

// A peer's report is whole: a tenant it no longer lists has no usage there.
func TestReportIsWhole(t *testing.T) {
	l := New(Config{PeerTTL: 10 * time.Second})
	lim := Limits{RequestsPerMinute: 100}
	l.Merge("r1", t0, []TenantUsage{{Tenant: "a", Used: Usage{Requests: 100}}})
	if l.Admit("a", lim, oneRequest, t0).OK {
		t.Fatal("admitted past the peer's usage")
	}
	l.Merge("r1", t0.Add(time.Second), nil)
	if !l.Admit("a", lim, oneRequest, t0.Add(time.Second)).OK {
		t.Fatal("a report without the tenant still counted its old usage")
	}
}

func TestIdleTenantsAreForgotten(t *testing.T) {
	l := New(Config{PeerTTL: time.Second})
	for i := 0; i < 1000; i++ {
		name := strconv.Itoa(i)
		l.Admit(name, Limits{RequestsPerMinute: 5}, oneRequest, t0)
		l.Charge(name, oneRequest, t0)
	}
	if n := len(l.Report(t0, nil)); n != 1000 {
		t.Fatalf("reported %d tenants", n)
	}
	l.Merge("r1", t0, []TenantUsage{{Tenant: "peer-only", Used: oneRequest}})
	l.Merge("r1", t0.Add(time.Second), nil)
	if n := len(l.Report(t0.Add(2*time.Minute), nil)); n != 0 || len(l.tenants) != 0 {
		t.Fatalf("after two idle minutes: %d reported, %d held", n, len(l.tenants))
	}
}

func BenchmarkAdmit(b *testing.B) {
	l := New(Config{PeerTTL: 2 * time.Second})
	lim := Limits{RequestsPerMinute: 1 << 40, TokensPerMinute: 1 << 50}
	for p := 0; p < 7; p++ {
		l.Merge("r"+strconv.Itoa(p), t0, []TenantUsage{{Tenant: "t", Used: Usage{Requests: 10, Tokens: 1000}}})
	}
	u := Usage{Requests: 1, Tokens: 300}
	b.ReportAllocs()
	for b.Loop() {
		if l.Admit("t", lim, u, t0).OK {
			l.Charge("t", u, t0)
		}
	}
}
