// Package costfit fits the routing cost model to the times to first token a
// router measures. The model is linear:
//
//	ttft = base + per_token·prefill_tokens + per_running·running
//
// where prefill_tokens is the prefill queued ahead of a request plus its own
// uncached tokens, and running counts the sequences decoding at the replica
// when it was routed. A Fit starts at the configured coefficients (the
// prior) and moves to what the fleet shows: ridge regression toward the
// prior over exponentially forgotten observations, so a few odd requests
// cannot pull it far, and it follows a fleet that changes (another GPU,
// another model behind the name) within a few thousand requests.
//
// A Fit is a pure value: observations in, coefficients out, no clock and no
// locking (the caller serializes).
package costfit

import (
	"math"
	"time"
)

// Coefficients are the cost model's terms.
type Coefficients struct {
	// Base is paid by every request whatever its replica: the network, the
	// engine's HTTP front, its first scheduling step's floor.
	Base time.Duration
	// PerToken is the engine time to prefill one token.
	PerToken time.Duration
	// PerRunning is the delay each running sequence adds before a new
	// request's first token.
	PerRunning time.Duration
}

const (
	// window is how many observations the fit remembers: each new one
	// multiplies the weight of all before it by 1 − 1/window.
	window = 2000
	// priorWeight is how many typical observations the prior on each term
	// weighs. The base's prior is 0 (the network and the engine's front are
	// unknown beforehand) and as firm as the slopes': a free base would let
	// a few observations trade it against a slope.
	priorWeight = 10
	// minObservations is how many observations the fit takes before it
	// answers anything but its prior: a handful of requests, likely from one
	// burst, can trade one term against another.
	minObservations = 100
	// bound is how far a fitted slope may move from its prior, either
	// way: a correction of the calibration, not a new model.
	bound = 8
	// maxBase bounds the fitted base.
	maxBase = 10 * time.Second
	// outlierFactor and outlierSlack clip a measured TTFT to this multiple
	// of its prediction plus the slack: a request held up by something
	// the model does not describe (a preemption, a stalled client read)
	// moves the fit as one far point, not as an unbounded square.
	outlierFactor = 4
	outlierSlack  = 100 * time.Millisecond
)

// Features are scaled so that typical values are near 1: the normal
// equations stay well conditioned in float64.
const (
	tokenUnit   = 1000 // tokens
	runningUnit = 10   // sequences
)

// Fit is an online fit of Coefficients. The zero value is not usable: call New.
type Fit struct {
	prior [3]float64 // seconds per feature unit: base, per_token, per_running
	a     [3][3]float64
	b     [3]float64
	n     float64 // the forgotten observation count: Σ weights
	added int     // observations taken, up to minObservations
	theta [3]float64
}

// New returns a fit that answers prior until observations say otherwise.
func New(prior Coefficients) *Fit {
	f := &Fit{prior: [3]float64{
		prior.Base.Seconds(),
		prior.PerToken.Seconds() * tokenUnit,
		prior.PerRunning.Seconds() * runningUnit,
	}}
	f.theta = f.prior
	return f
}

func features(prefillTokens, running int) [3]float64 {
	return [3]float64{1, float64(max(prefillTokens, 0)) / tokenUnit, float64(max(running, 0)) / runningUnit}
}

func (f *Fit) predict(x [3]float64) float64 {
	return f.theta[0]*x[0] + f.theta[1]*x[1] + f.theta[2]*x[2]
}

// Add takes one observation: a request with prefillTokens of prefill to wait
// for at a replica running running sequences had its first token after
// ttft.
func (f *Fit) Add(prefillTokens, running int, ttft time.Duration) {
	x := features(prefillTokens, running)
	y := max(ttft.Seconds(), 0)
	y = min(y, outlierFactor*max(f.predict(x), 0)+outlierSlack.Seconds())
	const keep = 1 - 1.0/window
	for i := range 3 {
		for j := range 3 {
			f.a[i][j] = f.a[i][j]*keep + x[i]*x[j]
		}
		f.b[i] = f.b[i]*keep + x[i]*y
	}
	f.n = f.n*keep + 1
	f.added = min(f.added+1, minObservations)
	f.solve()
}

// solve sets theta to the ridge solution (A + Λ)θ = b + Λ·prior, within
// bounds. Λ weighs each term's prior as priorWeight observations of its
// feature's mean square (at least one unit: a feature never seen keeps its
// prior). The mean square, not the variance: it is what the data's own
// weight on a slope grows with, so a few observations that happen to share
// a value cannot pull a slope far; at the window's full weight the prior
// biases a slope by about priorWeight/window × mean square/variance (≈ 2 %
// for running counts spread as widely as their mean).
//
// A term the solution puts out of bounds is held at the bound it crossed
// and the others are solved again given it, rather than clamped after they
// took its unbounded value into account: a prefill slope capped at 8× its
// prior leaves the rest of the TTFT it explained to the base and the
// running term, instead of to nothing.
func (f *Fit) solve() {
	var m [3][4]float64
	for i := range 3 {
		copy(m[i][:3], f.a[i][:])
		lambda := priorWeight * max(f.a[i][i]/f.n, 1)
		m[i][i] += lambda
		m[i][3] = f.b[i] + lambda*f.prior[i]
	}
	lo := [3]float64{0, f.prior[1] / bound, f.prior[2] / bound}
	hi := [3]float64{maxBase.Seconds(), f.prior[1] * bound, f.prior[2] * bound}
	var theta [3]float64
	// Each pass holds at least one more term, so three passes settle.
	for range 3 {
		var ok bool
		if theta, ok = solve3(m); !ok {
			return
		}
		held := false
		for i := range 3 {
			if v := clamp(theta[i], lo[i], hi[i]); v != theta[i] {
				m[i] = [4]float64{}
				m[i][i], m[i][3] = 1, v
				held = true
			}
		}
		if !held {
			break
		}
	}
	for i := range 3 {
		theta[i] = clamp(theta[i], lo[i], hi[i])
	}
	f.theta = theta
}

// solve3 solves the augmented 3×3 system m by Gaussian elimination with
// partial pivoting.
func solve3(m [3][4]float64) ([3]float64, bool) {
	for col := range 3 {
		p := col
		for r := col + 1; r < 3; r++ {
			if math.Abs(m[r][col]) > math.Abs(m[p][col]) {
				p = r
			}
		}
		if math.Abs(m[p][col]) < 1e-12 {
			return [3]float64{}, false
		}
		m[col], m[p] = m[p], m[col]
		for r := col + 1; r < 3; r++ {
			k := m[r][col] / m[col][col]
			for c := col; c < 4; c++ {
				m[r][c] -= k * m[col][c]
			}
		}
	}
	var x [3]float64
	for r := 2; r >= 0; r-- {
		s := m[r][3]
		for c := r + 1; c < 3; c++ {
			s -= m[r][c] * x[c]
		}
		x[r] = s / m[r][r]
	}
	for _, v := range x {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return [3]float64{}, false
		}
	}
	return x, true
}

func clamp(v, lo, hi float64) float64 { return min(max(v, lo), hi) }

func seconds(s float64) time.Duration { return time.Duration(math.Round(s * float64(time.Second))) }

// Coefficients returns the fitted model: the prior until minObservations.
func (f *Fit) Coefficients() Coefficients {
	if f.added < minObservations {
		return seconds3(f.prior)
	}
	return seconds3(f.theta)
}

func seconds3(theta [3]float64) Coefficients {
	return Coefficients{
		Base:       seconds(theta[0]),
		PerToken:   seconds(theta[1] / tokenUnit),
		PerRunning: seconds(theta[2] / runningUnit),
	}
}

// Observations is the weight of the observations the fit remembers: their
// count while it is well under the window, about the window after.
func (f *Fit) Observations() float64 { return f.n }
