// Command bareproxy is the floor BenchmarkProxyVsNginx measures the router
// against: a fasthttp server that relays every request to one upstream over
// a keep-alive fasthttp.HostClient and does nothing else (no parsing,
// routing, headers or metrics). Built by the benchmark only.
package main

import (
	"flag"
	"log"

	"github.com/valyala/fasthttp"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "listen address")
	upstream := flag.String("upstream", "", "upstream host:port")
	flag.Parse()
	hc := &fasthttp.HostClient{Addr: *upstream, MaxConns: 1024}
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		if err := hc.Do(&ctx.Request, &ctx.Response); err != nil {
			ctx.Error(err.Error(), fasthttp.StatusBadGateway)
		}
	}}
	log.Fatal(srv.ListenAndServe(*listen))
}
