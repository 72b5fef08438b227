package routing

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvmesh/kvmesh/costfit"
)

// Config holds the cost model and thresholds. Zero fields take defaults
// calibrated on an 8B model on one H200 (see ../shared/calibration): prefill
// costs about 30 µs per uncached token; each running sequence slows the steps
// that a new prefill shares with it.
type Config struct {
	// PrefillPerToken is the engine time to prefill one uncached token.
	PrefillPerToken time.Duration
	// PerRunning is the delay each running sequence adds to a new request's
	// first token: a step decodes every running sequence (37 µs plus 405 ns
	// per context token each, on the calibration's H200: 0.85–1.7 ms at
	// 2,000–4,000 tokens), and a new request sits through about a step and
	// a half, the one under way and the one its prefill shares.
	PerRunning time.Duration
	// TokensPerWaiting estimates the prefill work of a request the engine
	// reports waiting when no router has told us its size.
	TokensPerWaiting int
	// LoadBound is consistent hashing's bound: a replica may take a key only
	// while its load is at most LoadBound × the mean (CHWBL's 1+ε).
	LoadBound float64
	// ColdSlack lets kvaware keep a cold prefix on its consistent-hash home
	// when that home's predicted TTFT is within this much of the best one, so
	// routers agree on where new prefixes go.
	ColdSlack time.Duration
	// ImbalanceEnter and ImbalanceExit are the ratios of the most loaded
	// replica's queue to the mean queue at which kvaware switches to
	// least-load mode and back; ImbalanceMinQueue is the queue below which
	// no imbalance counts.
	ImbalanceEnter    float64
	ImbalanceExit     float64
	ImbalanceMinQueue time.Duration
	// SpeculativeTTL is how long a routed request's blocks count as resident
	// at its replica before the replica's own events confirm them, so bursts
	// of siblings co-locate; SpeculativeMaxKeys bounds the records.
	SpeculativeTTL     time.Duration
	SpeculativeMaxKeys int
	// Calibrate makes kvaware decide by the cost model it fits, per model,
	// to the times to first token the router measures (see Learner and
	// package costfit) instead of by PrefillPerToken and PerRunning, which
	// are then where each fit starts and what it is held near. kvaware fits
	// either way (CostModels); off by default: in the load tests deciding
	// by the fit gained nothing and under overload it can feed on itself
	// (loadtest/README.md).
	Calibrate bool
	// OffloadPerToken is the engine time to load one token's KV back from
	// an offload tier instead of computing it (default 2.6 µs: a Llama-3-8B
	// token's 128 KiB over PCIe Gen5 x16 at ≈ 50 GB/s of pinned DMA, which
	// is enginesim's --cpu-load-us-per-token default); OffloadPerTokenBy
	// sets it per medium (upper case, e.g. "CPU", "DISK"). A hit there is
	// priced between free (a GPU hit) and recompute: a cost above the
	// prefill cost counts as the prefill cost.
	OffloadPerToken   time.Duration
	OffloadPerTokenBy map[string]time.Duration

	cost costfit.Coefficients // the configured cost model
}

// DefaultPrefillPerToken is Config.PrefillPerToken's default: the
// calibration's 28.2 µs per token on an H200 (engine.DefaultCost), rounded.
const DefaultPrefillPerToken = 30 * time.Microsecond

func (c Config) withDefaults() Config {
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.PrefillPerToken, DefaultPrefillPerToken)
	def(&c.PerRunning, 1500*time.Microsecond)
	def(&c.ColdSlack, 50*time.Millisecond)
	def(&c.ImbalanceMinQueue, 2*time.Second)
	def(&c.SpeculativeTTL, 2*time.Second)
	def(&c.OffloadPerToken, DefaultOffloadPerToken)
	if c.TokensPerWaiting == 0 {
		c.TokensPerWaiting = 1024
	}
	if c.LoadBound == 0 {
		c.LoadBound = 1.25
	}
	if c.ImbalanceEnter == 0 {
		c.ImbalanceEnter = 4
	}
	if c.ImbalanceExit == 0 {
		c.ImbalanceExit = 2
	}
	if c.SpeculativeMaxKeys == 0 {
		c.SpeculativeMaxKeys = 1 << 20
	}
	c.cost = costfit.Coefficients{PerToken: c.PrefillPerToken, PerRunning: c.PerRunning}
	return c
}

// check rejects settings no cost model or threshold can mean: a negative
// cost would make a busy replica look cheaper than an idle one.
func (c Config) check() error {
	var errs []error
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"prefill_per_token", c.PrefillPerToken}, {"per_running", c.PerRunning}, {"cold_slack", c.ColdSlack},
		{"imbalance_min_queue", c.ImbalanceMinQueue}, {"speculative_ttl", c.SpeculativeTTL}, {"offload_per_token", c.OffloadPerToken}} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("routing: %s must not be negative (got %v)", d.name, d.v))
		}
	}
	for m, v := range c.OffloadPerTokenBy {
		if v < 0 {
			errs = append(errs, fmt.Errorf("routing: offload_per_token of %s must not be negative (got %v)", m, v))
		}
	}
	if c.TokensPerWaiting < 0 || c.SpeculativeMaxKeys < 0 {
		errs = append(errs, errors.New("routing: tokens_per_waiting and speculative_max_keys must not be negative"))
	}
	if c.LoadBound < 1 {
		errs = append(errs, fmt.Errorf("routing: load_bound %g is below 1: no replica could take a key while loads are even", c.LoadBound))
	}
	if c.ImbalanceExit < 1 || c.ImbalanceEnter < c.ImbalanceExit {
		errs = append(errs, fmt.Errorf("routing: want 1 <= imbalance_exit <= imbalance_enter (got %g and %g)", c.ImbalanceExit, c.ImbalanceEnter))
	}
	return errors.Join(errs...)
}

// queuedTokens is the prefill waiting at c ahead of a new request.
func (cfg *Config) queuedTokens(c *Candidate) int {
	return max(c.PendingPrefillTokens, c.Waiting*cfg.TokensPerWaiting)
}

// queue is the engine time already ahead of a new request at c under cost k.
func (cfg *Config) queue(k *costfit.Coefficients, c *Candidate) time.Duration {
	return time.Duration(cfg.queuedTokens(c))*k.PerToken + time.Duration(c.Running)*k.PerRunning
}

// ttft predicts the time to first token of req at c given matched tokens.
func (cfg *Config) ttft(k *costfit.Coefficients, c *Candidate, promptTokens, matched int) time.Duration {
	return k.Base + cfg.queue(k, c) + time.Duration(promptTokens-matched)*k.PerToken
}

// DefaultOffloadPerToken is Config.OffloadPerToken's default.
const DefaultOffloadPerToken = 2600 * time.Nanosecond

// offloadCost is the engine time to load one token's KV back from medium,
// at most k's prefill cost: loading is never dearer than recomputing.
func (cfg *Config) offloadCost(k *costfit.Coefficients, medium string) time.Duration {
	v, ok := cfg.OffloadPerTokenBy[medium]
	if !ok {
		v = cfg.OffloadPerToken
	}
	return min(v, k.PerToken)
}

// loadTime is the time c spends loading the offloaded part of its matched
// tokens back.
func (cfg *Config) loadTime(k *costfit.Coefficients, c *Candidate, matched int) time.Duration {
	n := offloaded(c, matched)
	if n == 0 {
		return 0
	}
	return time.Duration(n) * cfg.offloadCost(k, c.OffloadMedium)
}

// offloaded is the part of matched tokens at c held only on an offload
// tier. The GPU blocks come first in the prefix, so a match cut short
// (at the prompt's cacheable tokens) loses offloaded tokens first, and one
// extended (speculative records) adds to the GPU part.
func offloaded(c *Candidate, matched int) int {
	if !c.PrefixAware || c.OffloadedTokens <= 0 {
		return 0
	}
	gpu := c.MatchedTokens - c.OffloadedTokens
	return min(c.OffloadedTokens, max(matched-gpu, 0))
}

// outstanding is the request count least-load balancing compares.
func outstanding(c *Candidate) int {
	return max(c.InflightRequests, c.Waiting+c.Running)
}
