package costfit

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

var calibrated = Coefficients{PerToken: 30 * time.Microsecond, PerRunning: 1500 * time.Microsecond}

// within reports whether got is within frac of want.
func within(got, want time.Duration, frac float64) bool {
	return math.Abs(float64(got-want)) <= frac*float64(want)
}

// fleet draws observations from a linear truth with noise: prompts of
// 200–8,000 tokens, queued prefill of 0–20,000, 0–60 running sequences.
func observe(f *Fit, truth Coefficients, n int, rng *rand.Rand) {
	for range n {
		tokens := 200 + rng.IntN(7800) + rng.IntN(3)*rng.IntN(20000)
		running := rng.IntN(61)
		ttft := truth.Base + time.Duration(tokens)*truth.PerToken + time.Duration(running)*truth.PerRunning
		ttft = time.Duration(float64(ttft) * (0.9 + 0.2*rng.Float64()))
		f.Add(tokens, running, ttft)
	}
}

func TestFitFindsAnotherFleetsCosts(t *testing.T) {
	// A slower GPU than the prior's: 3× the prefill, 2.5× the decode, and
	// 20 ms of network and front end.
	truth := Coefficients{Base: 20 * time.Millisecond, PerToken: 90 * time.Microsecond, PerRunning: 3750 * time.Microsecond}
	f := New(calibrated)
	observe(f, truth, 3000, rand.New(rand.NewPCG(1, 2)))
	got := f.Coefficients()
	if !within(got.PerToken, truth.PerToken, 0.05) || !within(got.PerRunning, truth.PerRunning, 0.1) || (got.Base-truth.Base).Abs() > 15*time.Millisecond {
		// The base is the least certain term under noise proportional to
		// the TTFT (±10 % of a second is ±100 ms); it orders no replicas.
		t.Fatalf("fit %+v, truth %+v", got, truth)
	}
}

func TestFewObservationsLeaveThePrior(t *testing.T) {
	truth := Coefficients{PerToken: 90 * time.Microsecond, PerRunning: 4500 * time.Microsecond}
	f := New(calibrated)
	if got := f.Coefficients(); got != calibrated {
		t.Fatalf("before any observation: %+v, want the prior %+v", got, calibrated)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	observe(f, truth, minObservations-1, rng)
	if got := f.Coefficients(); got != calibrated {
		t.Fatalf("after %d observations: %+v, want the prior %+v", minObservations-1, got, calibrated)
	}
	observe(f, truth, 1, rng)
	if got := f.Coefficients(); got.PerToken <= 2*calibrated.PerToken || got.PerRunning <= 2*calibrated.PerRunning {
		t.Fatalf("after %d observations of a 3× slower fleet: %+v", minObservations, got)
	}
}

func TestAFeatureNeverSeenKeepsItsPrior(t *testing.T) {
	// An idle fleet: nothing ever runs beside a request, so nothing tells
	// what a running sequence costs.
	f := New(calibrated)
	rng := rand.New(rand.NewPCG(5, 6))
	for range 3000 {
		tokens := 100 + rng.IntN(6000)
		f.Add(tokens, 0, 10*time.Millisecond+time.Duration(tokens)*50*time.Microsecond)
	}
	got := f.Coefficients()
	if got.PerRunning != calibrated.PerRunning {
		t.Errorf("per_running %v, want the prior %v", got.PerRunning, calibrated.PerRunning)
	}
	if !within(got.PerToken, 50*time.Microsecond, 0.02) || !within(got.Base, 10*time.Millisecond, 0.2) {
		t.Errorf("fit %+v, want base 10ms per_token 50µs", got)
	}
}

func TestSlopesStayWithinBoundOfThePrior(t *testing.T) {
	f := New(calibrated)
	observe(f, Coefficients{PerToken: 2 * time.Millisecond, PerRunning: calibrated.PerRunning}, 3000, rand.New(rand.NewPCG(7, 8)))
	if got := f.Coefficients(); got.PerToken != calibrated.PerToken*bound {
		t.Errorf("per_token %v, want the upper bound %v", got.PerToken, calibrated.PerToken*bound)
	}
	f = New(calibrated)
	observe(f, Coefficients{PerToken: calibrated.PerToken, PerRunning: time.Microsecond}, 3000, rand.New(rand.NewPCG(7, 8)))
	if got := f.Coefficients(); got.PerRunning != calibrated.PerRunning/bound {
		t.Errorf("per_running %v, want the lower bound %v", got.PerRunning, calibrated.PerRunning/bound)
	}
}

func TestOutliersAreClipped(t *testing.T) {
	truth := Coefficients{Base: 5 * time.Millisecond, PerToken: 30 * time.Microsecond, PerRunning: 1500 * time.Microsecond}
	f := New(calibrated)
	rng := rand.New(rand.NewPCG(9, 10))
	observe(f, truth, 2000, rng)
	// One request in fifty stalls for a minute.
	for i := range 1000 {
		if i%50 == 0 {
			f.Add(2000, 10, time.Minute)
			continue
		}
		observe(f, truth, 1, rng)
	}
	if got := f.Coefficients(); !within(got.PerToken, truth.PerToken, 0.15) || !within(got.PerRunning, truth.PerRunning, 0.25) {
		t.Fatalf("fit %+v after stalls, truth %+v", got, truth)
	}
}

func TestFitFollowsAChangedFleet(t *testing.T) {
	f := New(calibrated)
	rng := rand.New(rand.NewPCG(11, 12))
	observe(f, Coefficients{PerToken: 90 * time.Microsecond, PerRunning: 4 * time.Millisecond}, 3000, rng)
	// The model behind the name is replaced by a smaller one.
	after := Coefficients{Base: 2 * time.Millisecond, PerToken: 15 * time.Microsecond, PerRunning: time.Millisecond}
	observe(f, after, 5*window, rng)
	if got := f.Coefficients(); !within(got.PerToken, after.PerToken, 0.1) || !within(got.PerRunning, after.PerRunning, 0.2) {
		t.Fatalf("fit %+v, want near %+v", got, after)
	}
	if n := f.Observations(); n < 0.9*window || n > window {
		t.Errorf("Observations() = %v, want about the window %d", n, window)
	}
}

func TestDegenerateObservationsKeepAUsableFit(t *testing.T) {
	f := New(calibrated)
	for range 100 {
		f.Add(0, 0, 0)
		f.Add(-5, -1, -time.Second)
	}
	got := f.Coefficients()
	if got.PerToken < calibrated.PerToken/bound || got.PerRunning < calibrated.PerRunning/bound || got.Base < 0 {
		t.Fatalf("fit %+v", got)
	}
}

func BenchmarkAdd(b *testing.B) {
	f := New(calibrated)
	for i := range b.N {
		f.Add(1000+i%4000, i%50, 40*time.Millisecond)
	}
}

func TestTermsWithinBoundAreFittedGivenAHeldOne(t *testing.T) {
	// Prefill 12× dearer than the prior: its slope is held at 8×, and the
	// TTFT it leaves unexplained must go to the base (prompt sizes do not
	// vary with running counts here), so that predictions stay unbiased.
	truth := Coefficients{Base: 5 * time.Millisecond, PerToken: 12 * calibrated.PerToken, PerRunning: calibrated.PerRunning}
	f := New(calibrated)
	observe(f, truth, 3000, rand.New(rand.NewPCG(13, 14)))
	got := f.Coefficients()
	if got.PerToken != calibrated.PerToken*bound {
		t.Fatalf("per_token %v, want the upper bound %v", got.PerToken, calibrated.PerToken*bound)
	}
	var sumTTFT, sumErr time.Duration
	rng := rand.New(rand.NewPCG(15, 16))
	for range 1000 {
		tokens := 200 + rng.IntN(7800) + rng.IntN(3)*rng.IntN(20000)
		running := rng.IntN(61)
		ttft := truth.Base + time.Duration(tokens)*truth.PerToken + time.Duration(running)*truth.PerRunning
		sumTTFT += ttft
		sumErr += ttft - (got.Base + time.Duration(tokens)*got.PerToken + time.Duration(running)*got.PerRunning)
	}
	if bias := float64(sumErr) / float64(sumTTFT); math.Abs(bias) > 0.05 {
		t.Fatalf("fit %+v predicts %.0f%% of the mean TTFT too little (truth %+v)", got, 100*bias, truth)
	}
}
