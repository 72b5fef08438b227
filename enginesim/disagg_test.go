package enginesim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/tokenize"
)

// proxyPrefillParams is what vLLM's proxies send the prefill engine
// (toy_proxy_server.py): remote decode asked for, the rest null.
const proxyPrefillParams = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// completion is the part of an answer these tests read.
type completion struct {
	Choices []struct {
		Text string `json:"text"`
	} `json:"choices"`
	Usage            usage           `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

func complete(t *testing.T, ts *testServer, body string) (completion, []byte) {
	t.Helper()
	code, resp := ts.doHeader(t, "/v1/completions", body, "X-Request-Id", "req-1")
	var c completion
	if code != 200 || json.Unmarshal(resp, &c) != nil {
		t.Fatalf("status %d: %s", code, resp)
	}
	return c, resp
}

func heldBlocks(ts *testServer) int { return ts.srv.ranks[0].metrics.stats().HeldBlocks }

// awaitReleased waits (at most 2 s) for rank r of ts to hold no blocks: the
// decode engine's notification is sent in the background.
func awaitReleased(t *testing.T, ts *testServer, r int) {
	t.Helper()
	for i := 0; ts.srv.ranks[r].metrics.stats().HeldBlocks != 0; i++ {
		if i == 400 {
			t.Fatalf("rank %d still holds %d blocks", r, ts.srv.ranks[r].metrics.stats().HeldBlocks)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestTwoStepProtocolOverHTTP is vLLM's disaggregated request end to end:
// the proxy's prefill request to a prefill engine, whose answer names its
// held blocks in kv_transfer_params byte for byte as NixlConnector does;
// then the client's request with those parameters to a decode engine,
// which reads them (the prefill engine frees them once notified), reports
// all but the
// last prompt token cached, announces the received blocks exactly as the
// prefill engine announced computing them, and answers what one engine
// alone would have.
func TestTwoStepProtocolOverHTTP(t *testing.T) {
	prec, drec := &rankRecorder{batches: map[int][][]byte{}}, &rankRecorder{batches: map[int][][]byte{}}
	p := startServer(t, Config{KVRole: KVRolePrefill, EngineID: "prefill-a", Events: prec})
	d := startServer(t, Config{KVRole: KVRoleDecode, EngineID: "decode-a", Events: drec})
	agg := startServer(t, Config{})
	prompt := words("p", 200) // 201 tokens with BOS: 12 full blocks and one partial
	client := `{"model":"sim","prompt":"` + prompt + `","max_tokens":4}`

	prefillBody := strings.Replace(client, `"max_tokens":4}`, `"max_tokens":1,"stream":false,"kv_transfer_params":`+proxyPrefillParams+`}`, 1)
	pa, raw := complete(t, p, prefillBody)
	host, port, _ := net.SplitHostPort(p.addr)
	want := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0,1,2,3,4,5,6,7,8,9,10,11,12],` +
		`"remote_engine_id":"prefill-a","remote_request_id":"` + p.srv.idPrefix + `1","remote_host":"` + host + `","remote_port":` + port + `,"tp_size":1}`
	if string(pa.KVTransferParams) != want || !bytes.HasSuffix(raw, []byte(`}},"kv_transfer_params":`+want+`}`)) {
		t.Fatalf("prefill answer %s\nwant kv_transfer_params %s last", raw, want)
	}
	if pa.Usage.CompletionTokens != 1 || heldBlocks(p) != 13 {
		t.Fatalf("prefill: %+v, %d blocks held, want 1 token and 13 blocks", pa.Usage, heldBlocks(p))
	}

	decodeBody := strings.Replace(client, `"max_tokens":4}`, `"max_tokens":4,"kv_transfer_params":`+string(pa.KVTransferParams)+`}`, 1)
	da, raw := complete(t, d, decodeBody)
	if da.Usage.PromptTokensDetails.CachedTokens != 200 || da.Usage.CompletionTokens != 4 || da.KVTransferParams != nil {
		t.Fatalf("decode answer %s: want 200 cached tokens, 4 generated, no kv_transfer_params", raw)
	}
	awaitReleased(t, p, 0)
	alone, _ := complete(t, agg, client)
	if da.Choices[0].Text != alone.Choices[0].Text || alone.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("decode text %q, one engine's %q", da.Choices[0].Text, alone.Choices[0].Text)
	}

	// Both engines announce the 12 full blocks, byte for byte the same.
	ids, _ := tokenize.Builtin{}.Encode(prompt, true)
	hashes := blockkey.Append(nil, engine.DefaultHashSeed, ids, 16)
	stored := kvevents.AppendBatch(nil, &kvevents.Batch{Events: []kvevents.Event{{
		Kind: kvevents.KindBlockStored, BlockHashes: hashes[:12], TokenIDs: ids[:192], BlockSize: 16,
		Medium: "GPU", HasGroupIdx: true, SpecKind: "full_attention", ExtraKeys: append([]byte{0x9c}, bytes.Repeat([]byte{0xc0}, 12)...),
	}}}, kvevents.FormatVLLMMap)
	for name, rec := range map[string]*rankRecorder{"prefill": prec, "decode": drec} {
		batches := rec.take()[0]
		if len(batches) != 1 || !bytes.Equal(batches[0], stored) {
			t.Errorf("%s engine's batches %x\nwant one %x", name, batches, stored)
		}
	}
	// A chat completion's answer ends with them too.
	code, raw := p.doHeader(t, "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"kv_transfer_params":`+proxyPrefillParams+`}`)
	if code != 200 || !bytes.Contains(raw, []byte(`}},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[`)) || !bytes.HasSuffix(raw, []byte(`,"tp_size":1}}`)) {
		t.Fatalf("chat prefill answer %d %s", code, raw)
	}
	_, m := d.do(t, "GET", "/metrics", nil)
	for _, line := range []string{
		`vllm:external_prefix_cache_hits_total{engine="0",model_name="sim"} 201`,
		`vllm:prefix_cache_hits_total{engine="0",model_name="sim"} 0`,
	} {
		if !strings.Contains(string(m), line+"\n") {
			t.Errorf("decode metrics lack %q", line)
		}
	}
}

// TestSplitTTFTOverHTTP is the figure: time to first token of an
// 8,000-token prompt split (the prefill engine's TTFT, then the decode
// engine's: the transfer of 8,000 tokens at 3.3 µs and the last token's
// step) against one engine's, in simulated time, over HTTP in real time.
func TestSplitTTFTOverHTTP(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 1024, MaxNumSeqs: 8, MaxNumBatchedTokens: 8192, MaxModelLen: 8192, Cost: engine.DefaultCost}
	p := startServer(t, Config{Engine: cfg, KVRole: KVRolePrefill, TimeScale: 1})
	d := startServer(t, Config{Engine: cfg, KVRole: KVRoleDecode, TimeScale: 1})
	agg := startServer(t, Config{Engine: cfg, TimeScale: 1})
	prompt := words("p", 7999) // 8,000 tokens with BOS
	client := `{"prompt":"` + prompt + `","max_tokens":2`

	var pa completion
	var wallPrefill, wallDecode, wallAgg time.Duration
	timed := func(dst *time.Duration, f func()) func() {
		return func() { start := time.Now(); f(); *dst = time.Since(start) }
	}
	prefill := simTTFT(p, timed(&wallPrefill, func() { pa, _ = complete(t, p, client+`,"kv_transfer_params":`+proxyPrefillParams+`}`) }))
	decode := simTTFT(d, timed(&wallDecode, func() { complete(t, d, client+`,"kv_transfer_params":`+string(pa.KVTransferParams)+`}`) }))
	aggregated := simTTFT(agg, timed(&wallAgg, func() { complete(t, agg, client+`}`) }))
	t.Logf("TTFT of an 8,000-token prompt, simulated: aggregated %v; split %v = prefill %v + transfer and last token %v (wall, whole requests: aggregated %v, split %v + %v)",
		aggregated, prefill+decode, prefill, decode, wallAgg.Round(100*time.Microsecond), wallPrefill.Round(100*time.Microsecond), wallDecode.Round(100*time.Microsecond))
	if fmt.Sprint(aggregated, prefill, decode) != "259.94ms 259.94ms 31.44ms" {
		t.Fatalf("aggregated %v, prefill %v, decode %v: want 259.94ms 259.94ms 31.44ms (TestSplitTTFT)", aggregated, prefill, decode)
	}
}

// TestHeldBlocksExpire: blocks no decode engine reads are freed after the
// bound (here 100 ms of simulated time, the engine idle meanwhile); a
// decode engine given their parameters afterwards fails the request, as
// vLLM's default kv_load_failure_policy does, or with "recompute" computes
// the prompt itself.
func TestHeldBlocksExpire(t *testing.T) {
	p := startServer(t, Config{KVRole: KVRolePrefill, TimeScale: 1, KVTransferTimeout: 100 * time.Millisecond})
	d := startServer(t, Config{KVRole: KVRoleDecode, TimeScale: 0, KVLoadFailurePolicy: KVLoadRecompute})
	strict := startServer(t, Config{KVRole: KVRoleDecode, TimeScale: 0})
	client := `{"prompt":"` + words("p", 100) + `","max_tokens":1`
	start := time.Now()
	pa, _ := complete(t, p, client+`,"kv_transfer_params":`+proxyPrefillParams+`}`)
	if heldBlocks(p) != 7 {
		t.Fatalf("%d blocks held, want 7", heldBlocks(p))
	}
	for i := 0; heldBlocks(p) != 0 && i < 200; i++ {
		time.Sleep(5 * time.Millisecond)
	}
	if heldBlocks(p) != 0 || time.Since(start) < 100*time.Millisecond {
		t.Fatalf("%d blocks held after %v", heldBlocks(p), time.Since(start))
	}
	decodeBody := client + `,"kv_transfer_params":` + string(pa.KVTransferParams) + `}`
	da, _ := complete(t, d, decodeBody)
	if c := da.Usage.PromptTokensDetails.CachedTokens; c != 0 {
		t.Fatalf("decode with expired parameters: %d cached, want 0 (recomputed)", c)
	}
	for _, c := range []struct{ body, want string }{
		{decodeBody, `{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}`},
		{strings.Replace(decodeBody, `"max_tokens":1`, `"max_tokens":1,"stream":true`, 1),
			`data: {"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}` + "\n\ndata: [DONE]\n\n"},
	} {
		code, raw := strict.doHeader(t, "/v1/completions", c.body)
		if wantCode := map[bool]int{true: 200, false: 500}[strings.HasPrefix(c.want, "data:")]; code != wantCode || string(raw) != c.want {
			t.Errorf("fail policy: %d %q, want %d %q", code, raw, wantCode, c.want)
		}
	}
	if st := strict.srv.ranks[0].metrics.stats(); st.FinishedRequests != 0 || st.PromptTokens != 0 {
		t.Fatalf("failed requests reached the engine: %+v", st)
	}
}

// TestUnusableKVTransferParams: parameters vLLM cannot use. A non-object
// is refused; incomplete ones, ones naming blocks the prefill engine does
// not hold (other ids, another request, another engine) or an engine that
// is not there make the decode engine (policy recompute) compute the
// prompt itself, leaving
// what the prefill engine holds alone. Each role ignores the other side's
// parameters.
func TestUnusableKVTransferParams(t *testing.T) {
	p := startServer(t, Config{KVRole: KVRolePrefill, EngineID: "p"})
	d := startServer(t, Config{KVRole: KVRoleDecode, KVLoadFailurePolicy: KVLoadRecompute})
	client := `{"prompt":"` + words("p", 100) + `","max_tokens":1`
	pa, _ := complete(t, p, client+`,"kv_transfer_params":`+proxyPrefillParams+`}`)
	var good map[string]any
	if err := json.Unmarshal(pa.KVTransferParams, &good); err != nil {
		t.Fatal(err)
	}
	closed, _ := net.Listen("tcp", "127.0.0.1:0")
	closedPort := closed.Addr().(*net.TCPAddr).Port
	closed.Close()
	with := func(key string, v any) string {
		m := map[string]any{}
		for k, x := range good {
			m[k] = x
		}
		if v == nil {
			delete(m, key)
		} else {
			m[key] = v
		}
		b, _ := json.Marshal(m)
		return string(b)
	}
	for _, c := range []struct{ name, params string }{
		{"no block ids", `{"do_remote_prefill":true}`},
		{"no engine id", with("remote_engine_id", nil)},
		{"no request id", with("remote_request_id", nil)},
		{"empty block ids", with("remote_block_ids", []int{})},
		{"mistyped port", with("remote_port", "x")},
		{"other blocks", with("remote_block_ids", []int{0, 1})},
		{"another request", with("remote_request_id", p.srv.idPrefix+"99")},
		{"another engine", with("remote_engine_id", "q")},
		{"nobody there", with("remote_port", closedPort)},
	} {
		da, raw := complete(t, d, client+`,"kv_transfer_params":`+c.params+`}`)
		if da.Usage.PromptTokensDetails.CachedTokens != 0 || da.KVTransferParams != nil {
			t.Errorf("%s: %s, want the prompt computed locally", c.name, raw)
		}
		d.onLoop(t, func(e *engine.Engine) { _, _ = e.ResetPrefixCache(0) }) // no local hits for the next
	}
	if heldBlocks(p) != 7 {
		t.Fatalf("prefill engine holds %d blocks, want its 7 untouched", heldBlocks(p))
	}
	// The four reads that failed (not the parameters never used) count as
	// vLLM's failed NIXL transfers.
	if _, m := d.do(t, "GET", "/metrics", nil); !bytes.Contains(m, []byte("\nvllm:nixl_num_failed_transfers_total{engine=\"0\",model_name=\"sim\"} 4\n")) {
		t.Fatalf("decode metrics lack 4 failed transfers:\n%s", m)
	}

	code, raw := d.doHeader(t, "/v1/completions", client+`,"kv_transfer_params":5}`)
	if want := `{"error":{"message":"kv_transfer_params: Input should be a valid dictionary","type":"BadRequestError","param":null,"code":400}}`; code != 400 || string(raw) != want {
		t.Fatalf("non-object: %d %s, want 400 %s", code, raw, want)
	}

	// A decode engine ignores do_remote_decode: nothing held, no params.
	da, _ := complete(t, d, client+`,"kv_transfer_params":`+proxyPrefillParams+`}`)
	if da.KVTransferParams != nil || heldBlocks(d) != 0 {
		t.Fatalf("decode role held a prefill: %s, %d blocks", da.KVTransferParams, heldBlocks(d))
	}
	// A prefill engine ignores do_remote_prefill: it prefills itself.
	pa2, _ := complete(t, p, `{"prompt":"`+words("q", 100)+`","max_tokens":1,"kv_transfer_params":`+string(pa.KVTransferParams)+`}`)
	if pa2.Usage.PromptTokensDetails.CachedTokens != 0 || heldBlocks(p) != 7 {
		t.Fatalf("prefill role read a remote prefill: %+v, %d blocks held", pa2.Usage, heldBlocks(p))
	}
	// The side channel: a read leaves the blocks held (another decode
	// engine may read them still), the notification frees them, and both
	// answer 404 for blocks not held.
	held := `{"remote_engine_id":"p","remote_request_id":"` + p.srv.idPrefix + `1","remote_block_ids":[0,1,2,3,4,5,6]}`
	for _, c := range []struct {
		path, body string
		code       int
		answer     string
		held       int
	}{
		{readPath, strings.Replace(held, "6]", "9]", 1), 404, "", 7},
		{notifyPath, strings.Replace(held, "6]", "9]", 1), 404, "", 7},
		{readPath, held, 200, `{"held_blocks":7}`, 7},
		{readPath, held, 200, `{"held_blocks":7}`, 7},
		{notifyPath, held, 200, `{"released_blocks":7}`, 0},
		{notifyPath, held, 404, "", 0},
		{readPath, held, 404, "", 0},
	} {
		code, raw := p.doHeader(t, c.path, c.body)
		if code != c.code || (c.answer != "" && string(raw) != c.answer) || heldBlocks(p) != c.held {
			t.Fatalf("%s %s: %d %s, %d held; want %d %s, %d held", c.path, c.body, code, raw, heldBlocks(p), c.code, c.answer, c.held)
		}
	}
}

// TestSecondDecodeReadsTheSameBlocks: a decode engine that read the blocks
// but failed before its notification leaves them held, so another decode
// engine given the same parameters still receives them, as with vLLM.
func TestSecondDecodeReadsTheSameBlocks(t *testing.T) {
	p := startServer(t, Config{KVRole: KVRolePrefill, EngineID: "p"})
	d := startServer(t, Config{KVRole: KVRoleDecode})
	client := `{"prompt":"` + words("p", 100) + `","max_tokens":2`
	pa, _ := complete(t, p, client+`,"kv_transfer_params":`+proxyPrefillParams+`}`)
	// The first decode engine's read, then nothing (it died).
	if code, raw := p.doHeader(t, readPath, `{"remote_engine_id":"p","remote_request_id":"`+p.srv.idPrefix+`1","remote_block_ids":[0,1,2,3,4,5,6]}`); code != 200 {
		t.Fatalf("read: %d %s", code, raw)
	}
	da, _ := complete(t, d, client+`,"kv_transfer_params":`+string(pa.KVTransferParams)+`}`)
	if da.Usage.PromptTokensDetails.CachedTokens != 100 {
		t.Fatalf("second decode: %+v, want 100 cached", da.Usage)
	}
	awaitReleased(t, p, 0)
}

// FuzzKVTransferParams: any kv_transfer_params either fail as a client
// error or resolve, and usable remote parameters name a host and port.
func FuzzKVTransferParams(f *testing.F) {
	for _, seed := range []string{
		proxyPrefillParams,
		`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":5600,"tp_size":1}`,
		`{"do_remote_prefill":1,"remote_block_ids":[0],"remote_engine_id":null,"remote_request_id":"r","remote_host":"h","remote_port":"1"}`,
		`[]`, `null`, `{"do_remote_decode":0.0}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) {
			return // the request body's decoder refuses it first
		}
		p, rerr := parseKVTransferParams(bytes.TrimSpace(raw))
		if rerr != nil {
			if rerr.code != 400 {
				t.Fatalf("%q: %+v", raw, rerr)
			}
			return
		}
		_ = p.truthy("do_remote_decode") || p.truthy("do_remote_prefill")
		if rk, ok := p.remote(); ok && (rk.Host == "" || rk.Port <= 0 || rk.Port >= 1<<16 || len(rk.BlockIDs) == 0) {
			t.Fatalf("%q: usable %+v", raw, rk)
		}
	})
}

// TestHeldBlocksStallUntilTheyExpire: when held blocks leave no room, a
// request waits for them to expire, as on vLLM; at time scale 0 the
// simulated clock jumps to the expiry instead of the engine waiting
// forever.
func TestHeldBlocksStallUntilTheyExpire(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 16, MaxNumSeqs: 4, MaxNumBatchedTokens: 256, MaxModelLen: 256, Cost: engine.DefaultCost}
	p := startServer(t, Config{Engine: cfg, KVRole: KVRolePrefill, TimeScale: 0})
	complete(t, p, `{"prompt":"`+words("p", 200)+`","max_tokens":1,"kv_transfer_params":`+proxyPrefillParams+`}`)
	if heldBlocks(p) != 13 {
		t.Fatalf("%d blocks held, want 13", heldBlocks(p))
	}
	ttft := simTTFT(p, func() { complete(t, p, `{"prompt":"`+words("q", 100)+`","max_tokens":1}`) }) // needs 7 blocks: 3 are free
	if heldBlocks(p) != 0 || ttft < DefaultKVTransferTimeout {
		t.Fatalf("after the stall: %d blocks held, TTFT %v, want 0 and past the %v bound", heldBlocks(p), ttft, DefaultKVTransferTimeout)
	}
}

// TestDataParallelPrefillRanks: each rank names itself <engine id>_dp<R>,
// and the read frees the blocks on that rank.
func TestDataParallelPrefillRanks(t *testing.T) {
	p := startServer(t, Config{KVRole: KVRolePrefill, EngineID: "p", DataParallelSize: 2})
	d := startServer(t, Config{KVRole: KVRoleDecode})
	client := `{"prompt":"` + words("p", 40) + `","max_tokens":1`
	code, raw := p.doHeader(t, "/v1/completions", client+`,"kv_transfer_params":`+proxyPrefillParams+`}`, "X-data-parallel-rank", "1")
	var pa completion
	if code != 200 || json.Unmarshal(raw, &pa) != nil || !bytes.Contains(pa.KVTransferParams, []byte(`"remote_engine_id":"p_dp1"`)) {
		t.Fatalf("rank 1's prefill: %d %s", code, raw)
	}
	if got := p.srv.ranks[1].metrics.stats().HeldBlocks; got != 3 || heldBlocks(p) != 0 {
		t.Fatalf("held on rank 1: %d, rank 0: %d; want 3 and 0", got, heldBlocks(p))
	}
	da, _ := complete(t, d, client+`,"kv_transfer_params":`+string(pa.KVTransferParams)+`}`)
	if da.Usage.PromptTokensDetails.CachedTokens != 40 {
		t.Fatalf("decode %+v", da.Usage)
	}
	awaitReleased(t, p, 1)
}

// TestConcurrentSplitRequests: 64 two-step requests at once, with shared
// prefixes, through one prefill and one decode engine: every decode reads
// its prefill's blocks, and the prefill engine holds nothing at the end.
func TestConcurrentSplitRequests(t *testing.T) {
	p := startServer(t, Config{KVRole: KVRolePrefill})
	d := startServer(t, Config{KVRole: KVRoleDecode})
	const n = 64
	errs := make(chan string, n)
	for i := range n {
		go func() {
			prompt := words(fmt.Sprintf("g%d", i%8), 50) + " " + words(fmt.Sprintf("u%d", i), 30)
			client := `{"prompt":"` + prompt + `","max_tokens":3`
			code, raw := p.do(t, "POST", "/v1/completions", []byte(client+`,"kv_transfer_params":`+proxyPrefillParams+`}`))
			var pa, da completion
			if code != 200 || json.Unmarshal(raw, &pa) != nil || pa.KVTransferParams == nil {
				errs <- fmt.Sprintf("prefill %d: %d %s", i, code, raw)
				return
			}
			code, raw = d.do(t, "POST", "/v1/completions", []byte(client+`,"kv_transfer_params":`+string(pa.KVTransferParams)+`}`))
			if code != 200 || json.Unmarshal(raw, &da) != nil || da.Usage.PromptTokensDetails.CachedTokens != da.Usage.PromptTokens-1 {
				errs <- fmt.Sprintf("decode %d: %d %s", i, code, raw)
				return
			}
			errs <- ""
		}()
	}
	for range n {
		if e := <-errs; e != "" {
			t.Error(e)
		}
	}
	awaitReleased(t, p, 0)
}
