package gateway

import (
	"testing"

	"github.com/valyala/fasthttp"
)

// BenchmarkServeSmallCompletion runs the whole request path in process
// (parse, tokenize, route, proxy over loopback to a fixed-answer upstream,
// headers, accounting) for a small non-streamed completion.
func BenchmarkServeSmallCompletion(b *testing.B) {
	up := listen(b, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"id":"c","choices":[{"text":" world"}],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}`)
	}})
	r := newRouter(b, Settings{}, 1<<20)
	r.table.AddStatic("e1", up, []string{"bench"})
	b.ReportAllocs()
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
