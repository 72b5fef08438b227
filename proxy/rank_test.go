package proxy

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// TestRankUpstreamNamesItsRankOnEveryAttempt: each attempt to a rank's
// upstream names that rank once, in place of the client's; a retry to
// another rank names the other; an upstream of no rank passes the
// client's header on as it came.
func TestRankUpstreamNamesItsRankOnEveryAttempt(t *testing.T) {
	seen := make(chan string, 8)
	record := func(status int) fasthttp.RequestHandler {
		return func(ctx *fasthttp.RequestCtx) {
			var ranks []string
			for k, v := range ctx.Request.Header.All() {
				if strings.EqualFold(string(k), RankHeader) {
					ranks = append(ranks, string(v))
				}
			}
			seen <- strings.Join(ranks, ",")
			if status != 200 {
				ctx.Error("busy", status)
				return
			}
			jsonEngine(ctx)
		}
	}
	failing, ok := serve(t, record(503)), serve(t, record(200))
	opt := Options{FirstByteTimeout: 5 * time.Second}
	var targets []*Upstream
	for i, c := range []struct {
		url  string
		rank int
	}{{failing, 2}, {ok, 0}, {ok, -1}} {
		up, err := NewRankUpstream(fmt.Sprintf("r%d", i), c.url, "", c.rank, opt)
		if err != nil {
			t.Fatal(err)
		}
		if up.Rank() != c.rank {
			t.Fatalf("upstream %d: rank %d, want %d", i, up.Rank(), c.rank)
		}
		t.Cleanup(up.Close)
		targets = append(targets, up)
	}
	for _, c := range []struct {
		name    string
		targets []*Upstream
		client  string // the client's header, "" for none
		want    []string
	}{
		{"retried to another rank", targets[:2], "", []string{"2", "0"}},
		{"client's header replaced", targets[1:2], "7", []string{"0"}},
		{"no rank: client's header kept", targets[2:], "7", []string{"7"}},
		{"no rank, no header", targets[2:], "", []string{""}},
	} {
		rec := newRecorder()
		url := router(t, c.targets, false, rec)
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		req.SetRequestURI(url + "/v1/completions")
		req.Header.SetMethod(fasthttp.MethodPost)
		if c.client != "" {
			req.Header.Set("x-data-parallel-rank", c.client)
		}
		if err := fasthttp.Do(req, resp); err != nil || resp.StatusCode() != 200 {
			t.Fatalf("%s: %v, status %d", c.name, err, resp.StatusCode())
		}
		for i, want := range c.want {
			if got := <-seen; got != want {
				t.Errorf("%s: attempt %d named rank %q, want %q", c.name, i, got, want)
			}
		}
		fasthttp.ReleaseRequest(req)
		fasthttp.ReleaseResponse(resp)
	}
}
