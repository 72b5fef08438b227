package gateway

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/tokenize"
)

// TestResumeStreamsTakesOverABrokenStream: with ResumeStreams, a chat
// stream whose replica hangs up after two tokens is finished by the other
// replica, asked to continue the assistant text the client already has.
// chunk is a chat stream event carrying s.
func chunk(s string) string {
	return `data: {"choices":[{"index":0,"delta":{"content":"` + s + `"},"finish_reason":null}]}` + "\n\n"
}

// dyingEngine streams two events, then its connection drops mid-stream.
func dyingEngine(t *testing.T) string {
	return listen(t, &fasthttp.Server{Logger: log.New(io.Discard, "", 0), Handler: func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("text/event-stream")
		conn := ctx.Conn()
		ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
			fmt.Fprint(w, chunk("Hel")+chunk("lo, how are you doing"))
			_ = w.Flush()
			time.Sleep(100 * time.Millisecond) // the server sends them
			_ = conn.Close()
		})
	}})
}

func TestResumeStreamsTakesOverABrokenStream(t *testing.T) {
	dying := dyingEngine(t)
	var continued atomic.Value
	healthy := listen(t, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		continued.Store(string(ctx.PostBody()))
		ctx.SetContentType("text/event-stream")
		ctx.SetBodyString(chunk(" there") + `data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":0}}}` + "\n\ndata: [DONE]\n\n")
	}})
	r := newRouter(t, Settings{ResumeStreams: true}, 1<<20)
	r.table.AddStatic("a", dying, []string{testModel})
	r.table.AddStatic("b", healthy, []string{testModel})
	body := `{"model":"sim","stream":true,"max_tokens":10,"messages":[{"role":"user","content":"Greet me"}]}`
	for range 20 { // static replicas take turns: find a request that started on a
		res := r.post(t, "/v1/chat/completions", body)
		if res.header["x-kvmesh-replica"] != "a" {
			continue
		}
		if want := chunk("Hel") + chunk("lo, how are you doing") + chunk(" there") + "data: [DONE]\n\n"; res.body != want {
			t.Fatalf("client got %q, want %q", res.body, want)
		}
		var got struct {
			Messages             []map[string]string `json:"messages"`
			MaxTokens            int                 `json:"max_tokens"`
			ContinueFinalMessage bool                `json:"continue_final_message"`
			StreamOptions        map[string]bool     `json:"stream_options"`
		}
		if err := json.Unmarshal([]byte(continued.Load().(string)), &got); err != nil {
			t.Fatal(err)
		}
		// Two events carried several tokens: the budget shrinks by the
		// text's tokens, not the events.
		said, _ := tokenize.Builtin{}.Encode("Hello, how are you doing", false)
		if len(said) <= 2 {
			t.Fatalf("test text is %d tokens: too few to tell tokens from events", len(said))
		}
		if len(got.Messages) != 2 || got.Messages[1]["role"] != "assistant" || got.Messages[1]["content"] != "Hello, how are you doing" ||
			!got.ContinueFinalMessage || got.MaxTokens != 10-len(said) || !got.StreamOptions["include_usage"] {
			t.Fatalf("continuation asked %+v", got)
		}
		if m := r.get(t, "/metrics"); !strings.Contains(m.body, `kvmesh_router_errors_total{type="stream_resumed"} 1`) {
			t.Fatalf("metrics lack the resume:\n%s", m.body)
		}
		return
	}
	t.Fatal("no request was routed to replica a first")
}
