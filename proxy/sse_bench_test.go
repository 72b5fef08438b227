package proxy

import (
	"bufio"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// stampEngine streams n events interval apart; each carries its send time.
func stampEngine(n int, interval time.Duration) fasthttp.RequestHandler {
	return func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("text/event-stream")
		ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
			for range n {
				fmt.Fprintf(w, "data: {\"t\":%d,\"choices\":[{\"delta\":{\"content\":\"tok\"}}]}\n\n", time.Now().UnixNano())
				if w.Flush() != nil {
					return
				}
				time.Sleep(interval)
			}
			fmt.Fprint(w, "data: [DONE]\n\n")
			_ = w.Flush()
		})
	}
}

// eventDelays reads one SSE stream from base and returns each event's delay
// from its send time to its arrival.
func eventDelays(tb testing.TB, base string) []time.Duration {
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		tb.Fatal(err)
	}
	defer c.Close()
	fmt.Fprint(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
	br := bufio.NewReader(c)
	var out []time.Duration
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			tb.Fatal(err)
		}
		if strings.HasPrefix(line, "data: [DONE]") {
			return out
		}
		if rest, ok := strings.CutPrefix(line, "data: {\"t\":"); ok {
			i := strings.IndexByte(rest, ',')
			sent, _ := strconv.ParseInt(rest[:i], 10, 64)
			out = append(out, time.Duration(time.Now().UnixNano()-sent))
		}
	}
}

// BenchmarkSSEAddedLatency measures what the proxy adds to each event's
// delivery: per iteration one 50-event stream (2 ms apart) is read directly
// from the engine and one through the proxy; the difference of the median
// and p90 event delays is reported.
func BenchmarkSSEAddedLatency(b *testing.B) {
	engine := serve(b, stampEngine(50, 2*time.Millisecond))
	proxied := router(b, upstreams(b, engine), false, newRecorderDiscard())
	var direct, through []time.Duration
	for i := 0; i < b.N; i++ {
		direct = append(direct, eventDelays(b, engine)...)
		through = append(through, eventDelays(b, proxied)...)
	}
	slices.Sort(direct)
	slices.Sort(through)
	q := func(d []time.Duration, f float64) time.Duration { return d[int(f*float64(len(d)-1))] }
	b.ReportMetric(float64(q(through, 0.5)-q(direct, 0.5))/1e3, "added-p50-µs/event")
	b.ReportMetric(float64(q(through, 0.9)-q(direct, 0.9))/1e3, "added-p90-µs/event")
	b.ReportMetric(float64(q(direct, 0.5))/1e3, "direct-p50-µs")
}

func newRecorderDiscard() *recorder {
	r := newRecorder()
	r.done = make(chan struct{}, 1<<16)
	return r
}
