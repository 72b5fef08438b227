package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/tokenize"
)

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// residentHandler rebuilds the resident multiset from subscribed events.
type residentHandler struct {
	mu       sync.Mutex
	resident map[uint64]int
	batches  int
	cleared  int
}

func (h *residentHandler) HandleBatch(_ uint64, b *kvevents.Batch) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.batches++
	for _, ev := range b.Events {
		switch ev.Kind {
		case kvevents.KindBlockStored:
			for _, x := range ev.BlockHashes {
				h.resident[x]++
			}
		case kvevents.KindBlockRemoved:
			for _, x := range ev.BlockHashes {
				if h.resident[x]--; h.resident[x] == 0 {
					delete(h.resident, x)
				}
			}
		case kvevents.KindAllBlocksCleared:
			clear(h.resident)
			h.cleared++
		}
	}
}

func (h *residentHandler) HandleReset(string) {
	h.mu.Lock()
	clear(h.resident)
	h.mu.Unlock()
}

func (h *residentHandler) snapshot() (map[uint64]int, int, int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	m := make(map[uint64]int, len(h.resident))
	for k, v := range h.resident {
		m[k] = v
	}
	return m, h.batches, h.cleared
}

// TestBinaryPublishesEventsOverZMQ runs the command as main does and
// checks, through kvevents.Subscriber, the events of real HTTP requests:
// enginesim binding an ipc:// endpoint that the subscriber connects to
// (vLLM's usual topology, kept off the network), and enginesim connecting
// to a subscriber bound on loopback.
func TestBinaryPublishesEventsOverZMQ(t *testing.T) {
	t.Run("bind", func(t *testing.T) {
		ep := "ipc://" + t.TempDir() + "/kv.sock"
		testEventsOverZMQ(t, ep, kvevents.SubscriberConfig{Endpoint: ep})
	})
	t.Run("connect", func(t *testing.T) {
		addr := "tcp://" + freePort(t)
		testEventsOverZMQ(t, addr, kvevents.SubscriberConfig{Endpoint: addr, Bind: true})
	})
}

func testEventsOverZMQ(t *testing.T, pubEndpoint string, subCfg kvevents.SubscriberConfig) {
	httpAddr := freePort(t)
	h := &residentHandler{resident: map[uint64]int{}}
	subCfg.Topic = "kv@"
	subCfg.Logger = zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr}).Level(zerolog.WarnLevel)
	sub := kvevents.NewSubscriber(subCfg, h)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	subDone := make(chan struct{})
	go func() { _ = sub.Run(ctx); close(subDone) }()

	runErr := make(chan error, 1)
	go func() {
		runErr <- run(ctx, []string{"--listen", httpAddr, "--model", "sim", "--time-scale", "0", "--kv-blocks", "512",
			"--max-model-len", "4096", "--kv-events", pubEndpoint, "--kv-topic", "kv@sim", "--log-level", "warn"})
	}()
	client := &fasthttp.HostClient{Addr: httpAddr}
	post := func(path, body string) (int, string) {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		defer fasthttp.ReleaseRequest(req)
		defer fasthttp.ReleaseResponse(resp)
		req.SetRequestURI("http://" + httpAddr + path)
		req.Header.SetMethod("POST")
		req.SetBodyString(body)
		if err := client.DoTimeout(req, resp, 5*time.Second); err != nil {
			return 0, err.Error()
		}
		return resp.StatusCode(), string(resp.Body())
	}
	// The publisher dials in the background and PUB drops what it sends
	// before the connection is up: warm up until events arrive, then reset
	// so what follows is exact.
	deadline := time.Now().Add(10 * time.Second)
	warm := 0
	for {
		select {
		case err := <-runErr:
			t.Fatalf("enginesim exited: %v", err)
		default:
		}
		// A new prompt each time: a repeat would hit the cache and store
		// nothing new.
		warm++
		code, body := post("/v1/completions", fmt.Sprintf(`{"prompt":"warm up %d the event path with a prompt of more than sixteen tokens so that one block fills","max_tokens":2}`, warm))
		if _, n, _ := h.snapshot(); n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no KV events arrived within 10 s; subscriber %+v; last completion %d %s", sub.Stats(), code, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if code, body := post("/reset_prefix_cache", ""); code != 200 {
		t.Fatalf("reset: %d %s", code, body)
	}
	prompt := strings.Repeat("tokens make blocks and blocks make prefixes ", 10) // 70 pieces
	code, body := post("/v1/completions", `{"prompt":"`+prompt+`","max_tokens":20}`)
	if code != 200 {
		t.Fatalf("completion: %d %s", code, body)
	}
	ids, _ := tokenize.Builtin{}.Encode(prompt, true)
	want := blockkey.Append(nil, engine.DefaultHashSeed, ids, 16)
	// Prompt plus 19 computed output tokens fill this many blocks.
	full := (len(ids) + 19) / 16
	deadline = time.Now().Add(5 * time.Second)
	for {
		res, _, cleared := h.snapshot()
		ok := cleared == 1 && len(res) == full
		for _, k := range want {
			ok = ok && res[k] == 1
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("subscriber holds %d blocks (cleared %d), want the %d blocks of the request incl. prompt blocks %x", len(res), cleared, full, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	select {
	case err := <-runErr:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("enginesim did not stop")
	}
	<-subDone
}

func TestBadFlagsAreErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--kv-replay", "tcp://*:1"},
		{"--cost-profile", "floor_ms=-1"},
		{"--tokenizer", "/nonexistent/model"},
		{"--block-size", "0"},
		{"--max-model-len", "100000", "--kv-blocks", "10"},
		{"--time-scale", "-1"},
		{"--kv-events", "tcp://*:1", "--kv-events-format", "nope"},
		{"stray"},
		{"--listen", "256.0.0.1:1"},
	} {
		if err := run(context.Background(), append(args, "--log-level", "error")); err == nil {
			t.Fatalf("%v accepted", args)
		}
	}
}
