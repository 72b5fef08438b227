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

// poster posts to the command's HTTP server at addr, with header name and
// value pairs.
func poster(addr string) func(path, body string, header ...string) (int, string) {
	client := &fasthttp.HostClient{Addr: addr}
	return func(path, body string, header ...string) (int, string) {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		defer fasthttp.ReleaseRequest(req)
		defer fasthttp.ReleaseResponse(resp)
		req.SetRequestURI("http://" + addr + path)
		req.Header.SetMethod("POST")
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		req.SetBodyString(body)
		if err := client.DoTimeout(req, resp, 5*time.Second); err != nil {
			return 0, err.Error()
		}
		return resp.StatusCode(), string(resp.Body())
	}
}

// stopCommand ends the command run started and checks it returned cleanly.
func stopCommand(t *testing.T, cancel context.CancelFunc, runErr <-chan error) {
	t.Helper()
	cancel()
	select {
	case err := <-runErr:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("enginesim did not stop")
	}
}

// resetAndSend resets the prefix cache, then sends one completion of 20
// tokens with the header pairs given, and returns the hashes of its prompt
// blocks and how many blocks the request fills.
func resetAndSend(t *testing.T, post func(path, body string, header ...string) (int, string), header ...string) ([]uint64, int) {
	t.Helper()
	if code, body := post("/reset_prefix_cache", ""); code != 200 {
		t.Fatalf("reset: %d %s", code, body)
	}
	prompt := strings.Repeat("tokens make blocks and blocks make prefixes ", 10) // 70 pieces
	if code, body := post("/v1/completions", `{"prompt":"`+prompt+`","max_tokens":20}`, header...); code != 200 {
		t.Fatalf("completion: %d %s", code, body)
	}
	ids, _ := tokenize.Builtin{}.Encode(prompt, true)
	// Prompt plus 19 computed output tokens fill this many blocks.
	return blockkey.Append(nil, engine.DefaultHashSeed, ids, 16), (len(ids) + 19) / 16
}

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
	post := poster(httpAddr)
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
	want, full := resetAndSend(t, post)
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
	stopCommand(t, cancel, runErr)
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
		{"--data-parallel-size", "0"},
		{"--cpu-offload-blocks", "-1"},
		{"--cpu-offload-events", "full"},
		{"--cpu-offload-blocks", "100", "--cpu-load-us-per-token", "0"},
		{"--data-parallel-size", "2", "--kv-events", "ipc:///tmp/enginesim-dp-test.sock"},
		{"--kv-role", "producer"},
		{"--kv-load-failure-policy", "retry"},
		{"--kv-role", "decode", "--kv-transfer-us-per-token", "0"},
		{"--kv-role", "prefill", "--kv-transfer-timeout", "0s"},
	} {
		if err := run(context.Background(), append(args, "--log-level", "error")); err == nil {
			t.Fatalf("%v accepted", args)
		}
	}
}

func TestOffsetEndpointPortIsVLLMs(t *testing.T) {
	for _, tc := range []struct {
		endpoint string
		rank     int
		want     string
		err      bool
	}{
		{"tcp://*:5557", 0, "tcp://*:5557", false},
		{"tcp://*:5557", 3, "tcp://*:5560", false},
		{"tcp://10.0.0.7:5557", 1, "tcp://10.0.0.7:5558", false},
		{"tcp://[::1]:6000", 2, "tcp://[::1]:6002", false},
		{"inproc://cache", 2, "inproc://cache_dp2", false},
		{"", 5, "", false},
		{"ipc:///tmp/kv.sock", 0, "ipc:///tmp/kv.sock", false},
		{"ipc:///tmp/kv.sock", 1, "", true},
		{"tcp://host:port", 1, "", true},
	} {
		got, err := offsetEndpointPort(tc.endpoint, tc.rank)
		if got != tc.want || (err != nil) != tc.err {
			t.Errorf("offsetEndpointPort(%q, %d) = %q, %v; want %q, error %v", tc.endpoint, tc.rank, got, err, tc.want, tc.err)
		}
	}
}

// consecutivePorts finds n consecutive free loopback ports.
func consecutivePorts(t *testing.T, n int) int {
	t.Helper()
	for range 50 {
		first, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := first.Addr().(*net.TCPAddr).Port
		lns := []net.Listener{first}
		for i := 1; i < n; i++ {
			ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+i))
			if err != nil {
				break
			}
			lns = append(lns, ln)
		}
		for _, ln := range lns {
			ln.Close()
		}
		if len(lns) == n {
			return base
		}
	}
	t.Fatalf("no %d consecutive free ports", n)
	return 0
}

// rankHandler is a residentHandler that also keeps the ranks its batches
// carry.
type rankHandler struct {
	residentHandler
	ranks map[int]int
}

func (h *rankHandler) HandleBatch(seq uint64, b *kvevents.Batch) {
	h.mu.Lock()
	h.ranks[b.DPRank]++
	h.mu.Unlock()
	h.residentHandler.HandleBatch(seq, b)
}

// TestDataParallelRanksPublishOnShiftedPorts runs the command with two
// ranks connecting to tcp://127.0.0.1:P, as vLLM's ranks do, to
// subscribers bound on P and P+1: a request sent to rank 1 with
// X-data-parallel-rank shows up, with data_parallel_rank 1, on P+1 only.
func TestDataParallelRanksPublishOnShiftedPorts(t *testing.T) {
	base := consecutivePorts(t, 2)
	httpAddr := freePort(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var subs []*kvevents.Subscriber
	var handlers []*rankHandler
	var subsDone sync.WaitGroup
	for r := range 2 {
		h := &rankHandler{residentHandler{resident: map[uint64]int{}}, map[int]int{}}
		sub := kvevents.NewSubscriber(kvevents.SubscriberConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", base+r), Bind: true,
			Logger: zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr}).Level(zerolog.WarnLevel)}, h)
		subs, handlers = append(subs, sub), append(handlers, h)
		subsDone.Go(func() { _ = sub.Run(ctx) })
	}
	runErr := make(chan error, 1)
	go func() {
		runErr <- run(ctx, []string{"--listen", httpAddr, "--model", "sim", "--time-scale", "0", "--kv-blocks", "512",
			"--max-model-len", "4096", "--data-parallel-size", "2", "--kv-events", fmt.Sprintf("tcp://127.0.0.1:%d", base), "--log-level", "warn"})
	}()
	post := poster(httpAddr)
	// Each rank's publisher dials on its own: warm both up, then reset.
	deadline := time.Now().Add(10 * time.Second)
	for r, h := range handlers {
		for warm := 0; ; warm++ {
			select {
			case err := <-runErr:
				t.Fatalf("enginesim exited: %v", err)
			default:
			}
			code, body := post("/v1/completions", fmt.Sprintf(`{"prompt":"warm up rank %d try %d with a prompt of more than sixteen tokens so that one block fills","max_tokens":2}`, r, warm), "X-data-parallel-rank", fmt.Sprint(r))
			if _, n, _ := h.snapshot(); n > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no KV events from rank %d within 10 s; subscriber %+v; last completion %d %s", r, subs[r].Stats(), code, body)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	want, full := resetAndSend(t, post, "X-data-parallel-rank", "1")
	deadline = time.Now().Add(5 * time.Second)
	for {
		res1, _, cleared1 := handlers[1].snapshot()
		res0, _, cleared0 := handlers[0].snapshot()
		ok := cleared1 == 1 && cleared0 == 1 && len(res1) == full && len(res0) == 0
		for _, k := range want {
			ok = ok && res1[k] == 1
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("rank 1's subscriber holds %d blocks (cleared %d), rank 0's %d (cleared %d); want %d and 0", len(res1), cleared1, len(res0), cleared0, full)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for r, h := range handlers {
		h.mu.Lock()
		if len(h.ranks) != 1 || h.ranks[r] == 0 {
			t.Errorf("subscriber on port %d got batches of ranks %v, want only %d", base+r, h.ranks, r)
		}
		h.mu.Unlock()
	}
	stopCommand(t, cancel, runErr)
	subsDone.Wait()
}

// TestPrefillAndDecodeCommands: two commands, one per role, do vLLM's
// two-step request: the prefill command's kv_transfer_params name its own
// listen address and engine id, and the decode command reads the blocks
// there.
func TestPrefillAndDecodeCommands(t *testing.T) {
	prefillAddr, decodeAddr := freePort(t), freePort(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errs := [2]chan error{make(chan error, 1), make(chan error, 1)}
	for i, args := range [][]string{
		{"--listen", prefillAddr, "--kv-role", "prefill", "--kv-engine-id", "p0"},
		{"--listen", decodeAddr, "--kv-role", "decode"},
	} {
		go func() {
			errs[i] <- run(ctx, append(args, "--model", "sim", "--time-scale", "0", "--kv-blocks", "512", "--max-model-len", "4096", "--log-level", "warn"))
		}()
	}
	prompt := strings.Repeat("word ", 40) // 42 tokens with BOS and the trailing space
	var code int
	var body string
	for range 100 { // until the command listens
		if code, body = poster(prefillAddr)("/v1/completions", `{"prompt":"`+prompt+`","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}`); code != 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	host, port, _ := net.SplitHostPort(prefillAddr)
	i := strings.Index(body, `,"kv_transfer_params":`)
	want := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0,1,2],"remote_engine_id":"p0","remote_request_id":"`
	if code != 200 || i < 0 || !strings.HasPrefix(body[i+22:], want) || !strings.HasSuffix(body, `","remote_host":"`+host+`","remote_port":`+port+`,"tp_size":1}}`) {
		t.Fatalf("prefill: %d %s", code, body)
	}
	params := body[i+22 : len(body)-1]
	for range 100 {
		if code, body = poster(decodeAddr)("/v1/completions", `{"prompt":"`+prompt+`","max_tokens":3,"kv_transfer_params":`+params+`}`); code != 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code != 200 || !strings.Contains(body, `"prompt_tokens_details":{"cached_tokens":41}`) {
		t.Fatalf("decode: %d %s", code, body)
	}
	stopCommand(t, cancel, errs[0])
	stopCommand(t, func() {}, errs[1])
}
