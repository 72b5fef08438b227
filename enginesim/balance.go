package enginesim

import (
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// defaultBalanceInterval is how often vLLM's DP coordinator publishes the
// ranks' queue counts to the API server (stats_update_interval_ms, 100).
const defaultBalanceInterval = 100 * time.Millisecond

// rankBalancer places requests that name no rank the way vLLM v0.26.0's
// internal load balancer does (DPLBAsyncMPClient.get_core_engine_for_request
// in vllm/v1/engine/core_client.py, commit 568afb3a): the rank with the
// lowest waiting·4 + running in the last snapshot of the ranks' counts, the
// first such rank in rank order on a tie, and each placement counted as one
// more waiting request on its rank until the next snapshot replaces the
// counts. (Later vLLM main, e.g. 00080ee1, scores max(in-flight, waiting +
// running) plus a KV-pressure term and rotates the tie-break; v0.26.0 is
// what enginesim matches throughout.)
type rankBalancer struct {
	mu        sync.Mutex
	counts    [][2]int // per rank: waiting, running
	refreshed time.Time
	interval  time.Duration
	load      func(rank int) (waiting, running int)
}

func newRankBalancer(n int, interval time.Duration, load func(int) (int, int)) *rankBalancer {
	return &rankBalancer{counts: make([][2]int, n), interval: interval, load: load}
}

// pick returns the rank for a request arriving at now.
func (b *rankBalancer) pick(now time.Time) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.Sub(b.refreshed) >= b.interval {
		for i := range b.counts {
			b.counts[i][0], b.counts[i][1] = b.load(i)
		}
		b.refreshed = now
	}
	best, bestScore := 0, int(^uint(0)>>1)
	for i, c := range b.counts {
		if score := c[0]*4 + c[1]; score < bestScore {
			best, bestScore = i, score
		}
	}
	b.counts[best][0]++
	return best
}

// dataParallelRankHeader names the rank a request must go to (vLLM's
// OpenAIServing._get_data_parallel_rank, vllm/entrypoints/openai/engine/
// serving.py, v0.26 era).
const dataParallelRankHeader = "X-data-parallel-rank"

// pickRank chooses the rank serving a generation request: the one its
// X-data-parallel-rank header names, or the balancer's choice without one.
// A rank outside [0, size) is vLLM's 400, "data_parallel_rank R is out of
// range [0, N)." (InputProcessor.process_inputs, vllm/v1/engine/
// input_processor.py at commit 009daaee), with one rank too.
func (s *Server) pickRank(ctx *fasthttp.RequestCtx) (*rank, *requestError) {
	v := ctx.Request.Header.Peek(dataParallelRankHeader)
	if v != nil {
		if n, text, ok := pythonInt(string(v)); ok {
			if n < 0 || n >= int64(len(s.ranks)) {
				return nil, invalid("data_parallel_rank %s is out of range [0, %d).", text, len(s.ranks))
			}
			return s.ranks[n], nil
		}
	}
	if s.balancer == nil {
		return s.ranks[0], nil
	}
	return s.ranks[s.balancer.pick(time.Now())], nil
}

// pythonInt parses v as Python's int(v) does for the ASCII text a header
// holds: surrounding whitespace, an optional sign, decimal digits with
// single underscores between them. vLLM ignores a header int() refuses
// (the request is balanced as if it had none), so !ok means "no rank".
// text is the value as Python prints it, for the error message; n
// saturates where Python's int would not, which only matters for being
// out of range either way.
func pythonInt(v string) (n int64, text string, ok bool) {
	v = strings.Trim(v, " \t\n\v\f\r\x1c\x1d\x1e\x1f\x85\xa0")
	neg := false
	if v != "" && (v[0] == '+' || v[0] == '-') {
		neg = v[0] == '-'
		v = v[1:]
	}
	if v == "" || v[0] == '_' || v[len(v)-1] == '_' || strings.Contains(v, "__") {
		return 0, "", false
	}
	var digits []byte
	for i := 0; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '_':
			continue
		case c < '0' || c > '9':
			return 0, "", false
		case len(digits) == 0 && c == '0':
			continue // leading zero
		}
		digits = append(digits, c)
	}
	if len(digits) == 0 {
		return 0, "0", true
	}
	const limit = int64(^uint64(0) >> 1)
	for _, c := range digits {
		d := int64(c - '0')
		if n > (limit-d)/10 {
			n = limit
			break
		}
		n = n*10 + d
	}
	text = string(digits)
	if neg {
		n, text = -n, "-"+text
	}
	return n, text, true
}
