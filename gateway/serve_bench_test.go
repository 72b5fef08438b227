package gateway

import (
	"syscall"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// processCPU is the user+system CPU time of the whole test process.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU adds process CPU per operation (client, router and upstream
// together: the same harness for both benchmarks, so the difference is the
// router's own work).
func reportCPU(b *testing.B, start time.Duration) {
	b.ReportMetric(float64((processCPU()-start).Microseconds())/float64(b.N), "cpu-µs/op")
}

// BenchmarkServeSmallCompletion runs the whole request path in process
// (parse, tokenize, route, proxy over loopback to a fixed-answer upstream,
// headers, accounting) for a small non-streamed completion.
// With flow control on (and a fleet it finds unsaturated) it measures what
// admission adds to every request.
func BenchmarkServeSmallCompletion(b *testing.B) {
	b.Run("flow-off", func(b *testing.B) { benchServeSmall(b, Settings{}) })
	b.Run("flow-on", func(b *testing.B) { benchServeSmall(b, Settings{Flow: FlowControl{Enabled: true}}) })
}

func benchServeSmall(b *testing.B, s Settings) {
	up := listen(b, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"id":"c","choices":[{"text":" world"}],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}`)
	}})
	r := newRouter(b, s, 1<<20)
	r.table.AddStatic("e1", up, []string{"bench"})
	b.ReportAllocs()
	cpu0 := processCPU()
	defer func() { reportCPU(b, cpu0) }()
	b.RunParallel(func(pb *testing.PB) {
		var ctx fasthttp.RequestCtx
		for pb.Next() {
			ctx.Request.Reset()
			ctx.Response.Reset()
			ctx.Request.SetRequestURI("/v1/completions")
			ctx.Request.Header.SetMethod("POST")
			ctx.Request.SetBodyString(`{"model":"bench","prompt":"hello world","max_tokens":1}`)
			r.g.Handler(&ctx)
			if ctx.Response.StatusCode() != 200 {
				b.Fatalf("status %d: %s", ctx.Response.StatusCode(), ctx.Response.Body())
			}
		}
	})
}

// BenchmarkServeBareFasthttpProxy is the floor BenchmarkServeSmallCompletion
// is measured against: a fasthttp handler that only relays to the upstream.
func BenchmarkServeBareFasthttpProxy(b *testing.B) {
	up := listen(b, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"id":"c","choices":[{"text":" world"}],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}`)
	}})
	hc := &fasthttp.HostClient{Addr: up[len("http://"):], MaxConns: 1024}
	b.ReportAllocs()
	cpu0 := processCPU()
	defer func() { reportCPU(b, cpu0) }()
	b.RunParallel(func(pb *testing.PB) {
		var ctx fasthttp.RequestCtx
		for pb.Next() {
			ctx.Request.Reset()
			ctx.Response.Reset()
			ctx.Request.SetRequestURI("/v1/completions")
			ctx.Request.Header.SetMethod("POST")
			ctx.Request.SetBodyString(`{"model":"bench","prompt":"hello world","max_tokens":1}`)
			ctx.Request.SetHost(up[len("http://"):])
			if err := hc.Do(&ctx.Request, &ctx.Response); err != nil || ctx.Response.StatusCode() != 200 {
				b.Fatal(err)
			}
		}
	})
}
