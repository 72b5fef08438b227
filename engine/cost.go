package engine

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// CostProfile is the step time model:
//
//	step = Floor + PrefillPerToken·prefill_tokens + PrefillPerPair·attention_pairs
//	     + DecodePerSeq·decode_seqs + DecodePerContextToken·decode_context_tokens
//
// where attention_pairs sums, over every prefill chunk of n new tokens on top
// of c already computed ones, n·c + n²/2 (each new token attends to all
// before it), and decode_context_tokens sums the context of every decoding
// sequence. Units are in the JSON names.
type CostProfile struct {
	FloorMs                 float64 `json:"floor_ms"`
	PrefillUsPerToken       float64 `json:"prefill_us_per_token"`
	PrefillNsPerPair        float64 `json:"prefill_ns_per_pair"`
	DecodeUsPerSeq          float64 `json:"decode_us_per_seq"`
	DecodeNsPerContextToken float64 `json:"decode_ns_per_context_token"`
}

// DefaultCost is fitted to ../shared/calibration (Llama-3-8B shapes on one
// H200, eager PyTorch): least squares over the compute-bound prefill points
// (cold ≥ 2,048 tokens, warm +1,024, batched) gives 28.2 µs per token and
// 0.917 ns per attention pair (cold 2,048 → 59.7 ms vs 61.2 measured,
// 16,384 → 585 ms vs 583.7); the three batched decode points (8 and 32 at
// 3,200 context, 64 at 2,048) give 37 µs per sequence plus 405 ns per context
// token. The floor is not measured: the eager stack's ≈24 ms is Python and
// kernel-launch overhead that vLLM's CUDA graphs remove, so the default is a
// vLLM-like 5 ms.
var DefaultCost = CostProfile{
	FloorMs:                 5,
	PrefillUsPerToken:       28.2,
	PrefillNsPerPair:        0.917,
	DecodeUsPerSeq:          37,
	DecodeNsPerContextToken: 405,
}

// stepWork is what a step computes; the profile prices it.
type stepWork struct {
	prefillTokens  int64
	attentionPairs float64
	decodeSeqs     int64
	decodeContext  int64
}

// Duration prices one step's work.
func (p CostProfile) duration(w stepWork) time.Duration {
	ns := p.FloorMs*1e6 +
		p.PrefillUsPerToken*1e3*float64(w.prefillTokens) +
		p.PrefillNsPerPair*w.attentionPairs +
		p.DecodeUsPerSeq*1e3*float64(w.decodeSeqs) +
		p.DecodeNsPerContextToken*float64(w.decodeContext)
	return time.Duration(ns)
}

// ParseCostProfile overrides fields of base from spec: a JSON object
// (`{"floor_ms":3}`) or a comma list of key=value pairs with the same keys
// (`floor_ms=3,decode_us_per_seq=20`). Unknown keys and negative values are
// errors.
func ParseCostProfile(base CostProfile, spec string) (CostProfile, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return base, nil
	}
	p := base
	if strings.HasPrefix(spec, "{") {
		dec := json.NewDecoder(strings.NewReader(spec))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			return base, fmt.Errorf("cost profile: %w", err)
		}
	} else {
		fields := map[string]*float64{
			"floor_ms":                    &p.FloorMs,
			"prefill_us_per_token":        &p.PrefillUsPerToken,
			"prefill_ns_per_pair":         &p.PrefillNsPerPair,
			"decode_us_per_seq":           &p.DecodeUsPerSeq,
			"decode_ns_per_context_token": &p.DecodeNsPerContextToken,
		}
		for _, kv := range strings.Split(spec, ",") {
			k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
			dst := fields[strings.TrimSpace(k)]
			if !ok || dst == nil {
				return base, fmt.Errorf("cost profile: %q: want key=value with key one of floor_ms, prefill_us_per_token, prefill_ns_per_pair, decode_us_per_seq, decode_ns_per_context_token", kv)
			}
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return base, fmt.Errorf("cost profile: %s: %w", k, err)
			}
			*dst = f
		}
	}
	for _, f := range []float64{p.FloorMs, p.PrefillUsPerToken, p.PrefillNsPerPair, p.DecodeUsPerSeq, p.DecodeNsPerContextToken} {
		if f < 0 || f != f {
			return base, fmt.Errorf("cost profile: values must be ≥ 0, got %v", f)
		}
	}
	return p, nil
}
