package gateway

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/enginesim"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/tokenize"
)

// servePD serves an enginesim playing role, whose prefills name
// sideChannel as where their blocks are read ("": its own address).
func servePD(t *testing.T, role enginesim.KVRole, sideChannel string) (string, *fasthttp.Server) {
	t.Helper()
	return serveSim(t, enginesim.Config{
		Model: testModel, Tokenizer: tokenize.Builtin{}, KVRole: role, SideChannel: sideChannel,
		Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 64, MaxNumBatchedTokens: 8192, MaxModelLen: 32768},
	})
}

// pdRouter is a router in front of prefill and decode replicas (by name:
// URL), split by the cost rule with a 32-token threshold.
func pdRouter(t *testing.T, split plan.Split, prefill, decode map[string]string) *testRouter {
	t.Helper()
	r := newRouter(t, Settings{MaxAttempts: 3, Split: split, SplitMinUncached: 32}, 1<<20)
	now := time.Now()
	for role, reps := range map[fleet.KVRole]map[string]string{fleet.KVPrefill: prefill, fleet.KVDecode: decode} {
		for name, url := range reps {
			r.table.Upsert(fleet.Info{Name: name, Models: []string{testModel}, URL: url, Protocol: fleet.ProtocolVLLM, BlockSize: 16, KVRole: role}, now)
			r.table.SetLoad(name, fleet.Load{}, true, now)
		}
	}
	return r
}

const pdPrompt = "A long prompt that the cost rule sends to a prefill replica first, its KV then read by a decode replica. "

type pdAnswer struct {
	Choices []struct {
		Text string `json:"text"`
	} `json:"choices"`
	Usage struct {
		PromptTokens        int `json:"prompt_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

func completionBody(prompt string, maxTokens int, stream bool) string {
	q, _ := json.Marshal(prompt)
	return fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":%d,"stream":%v}`, testModel, q, maxTokens, stream)
}

// TestSplitRequest: a long prompt is prefilled at a prefill replica and
// decoded at a decode replica, streamed or not, with the same text a
// whole request gets; a short one is served whole on the decode pool.
func TestSplitRequest(t *testing.T) {
	p1, _ := servePD(t, enginesim.KVRolePrefill, "")
	d1, _ := servePD(t, enginesim.KVRoleDecode, "")
	whole, _ := servePD(t, enginesim.KVRoleBoth, "")
	r := pdRouter(t, plan.SplitAuto, map[string]string{"p1": p1}, map[string]string{"d1": d1})
	prompt := strings.Repeat(pdPrompt, 4)

	rep := r.post(t, "/v1/completions", completionBody(prompt, 8, false))
	var got, want pdAnswer
	if rep.status != 200 || json.Unmarshal([]byte(rep.body), &got) != nil {
		t.Fatalf("split: %d %s", rep.status, rep.body)
	}
	if err := json.Unmarshal([]byte(postJSON(t, whole+"/v1/completions", completionBody(prompt, 8, false))), &want); err != nil {
		t.Fatal(err)
	}
	h := rep.header
	if h["x-kvmesh-mode"] != "split" || h["x-kvmesh-replica"] != "d1" || h["x-kvmesh-prefill-replica"] != "p1" || h["x-kvmesh-prefill-cached-tokens"] != "0" {
		t.Errorf("headers %v", h)
	}
	if got.Choices[0].Text != want.Choices[0].Text || got.Usage.PromptTokens != want.Usage.PromptTokens {
		t.Errorf("split answer %+v, whole %+v", got, want)
	}
	// The decode read the prefill's KV: all but the last prompt token.
	if got.Usage.PromptTokensDetails.CachedTokens != got.Usage.PromptTokens-1 || got.KVTransferParams != nil {
		t.Errorf("decode usage %+v, params %s", got.Usage, got.KVTransferParams)
	}

	// The same prefix again: the prefill replica has it cached.
	rep = r.post(t, "/v1/completions", completionBody(prompt+"And a second question?", 8, true))
	if rep.status != 200 || rep.header["x-kvmesh-mode"] != "split" || !strings.Contains(rep.body, "data: [DONE]") {
		t.Fatalf("stream: %d %v %s", rep.status, rep.header, rep.body)
	}
	if c, _ := strconv.Atoi(rep.header["x-kvmesh-prefill-cached-tokens"]); c < 16*((got.Usage.PromptTokens-1)/16) {
		t.Errorf("second prefill found %d cached of a %d-token shared prefix", c, got.Usage.PromptTokens)
	}

	rep = r.post(t, "/v1/completions", completionBody("short", 4, false))
	if rep.status != 200 || rep.header["x-kvmesh-mode"] == "split" || rep.header["x-kvmesh-replica"] != "d1" || rep.header["x-kvmesh-prefill-replica"] != "" {
		t.Errorf("short prompt: %d %v", rep.status, rep.header)
	}
	if m := scrape(t, r, "kvmesh_router_prefills_total"); !strings.Contains(m, `outcome="ok"} 2`) {
		t.Errorf("metrics: %s", m)
	}
}

// TestSplitFaults: a prefill replica that does not answer → the next one;
// a decode replica that does not answer → the next one with the same
// transfer parameters; parameters no decode replica can read → the
// request whole at a decode replica; no prefill replica → whole.
func TestSplitFaults(t *testing.T) {
	p1, _ := servePD(t, enginesim.KVRolePrefill, "")
	d1, _ := servePD(t, enginesim.KVRoleDecode, "")
	prompt := strings.Repeat(pdPrompt, 3)
	body := completionBody(prompt, 6, false)

	r := pdRouter(t, plan.SplitAlways, map[string]string{"p0": refusedURL(t), "p1": p1}, map[string]string{"d0": refusedURL(t), "d1": d1})
	for i := range 4 { // whichever order the plan tries them in
		rep := r.post(t, "/v1/completions", body)
		if rep.status != 200 || rep.header["x-kvmesh-mode"] != "split" || rep.header["x-kvmesh-replica"] != "d1" || rep.header["x-kvmesh-prefill-replica"] != "p1" {
			t.Fatalf("try %d: %d %v %s", i, rep.status, rep.header, rep.body)
		}
	}

	// The prefill names a side channel nothing listens on: both decode
	// replicas fail to read it (vLLM's default kv_load_failure_policy
	// fails the request), and the request is served whole.
	pBad, _ := servePD(t, enginesim.KVRolePrefill, strings.TrimPrefix(refusedURL(t), "http://"))
	d2, _ := servePD(t, enginesim.KVRoleDecode, "")
	r = pdRouter(t, plan.SplitAlways, map[string]string{"p": pBad}, map[string]string{"d1": d1, "d2": d2})
	rep := r.post(t, "/v1/completions", body)
	if rep.status != 200 || rep.header["x-kvmesh-mode"] == "split" || rep.header["x-kvmesh-replica"][0] != 'd' {
		t.Fatalf("unreadable transfer: %d %v %s", rep.status, rep.header, rep.body)
	}

	r = pdRouter(t, plan.SplitAlways, map[string]string{"p": refusedURL(t)}, map[string]string{"d1": d1})
	if rep := r.post(t, "/v1/completions", body); rep.status != 200 || rep.header["x-kvmesh-mode"] == "split" || rep.header["x-kvmesh-replica"] != "d1" {
		t.Fatalf("no prefill replica: %d %v %s", rep.status, rep.header, rep.body)
	}
	if m := scrape(t, r, "kvmesh_router_prefills_total"); !strings.Contains(m, `outcome="failed"}`) {
		t.Errorf("metrics: %s", m)
	}
}

// TestSplitSurvivesKilledReplicas sends 1,000 split requests, streamed and
// not, while one prefill and one decode replica are killed part way: none
// fails.
func TestSplitSurvivesKilledReplicas(t *testing.T) {
	p1, ps1 := servePD(t, enginesim.KVRolePrefill, "")
	p2, _ := servePD(t, enginesim.KVRolePrefill, "")
	d1, ds1 := servePD(t, enginesim.KVRoleDecode, "")
	d2, _ := servePD(t, enginesim.KVRoleDecode, "")
	r := pdRouter(t, plan.SplitAlways, map[string]string{"p1": p1, "p2": p2}, map[string]string{"d1": d1, "d2": d2})
	const total, workers = 1000, 8
	var next, failed, split atomic.Int64
	var wg sync.WaitGroup
	var errMu sync.Mutex
	var firstErr string
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > total {
					return
				}
				switch i {
				case total / 4:
					go func() { _ = ps1.Shutdown() }()
				case total / 2:
					go func() { _ = ds1.Shutdown() }()
				}
				rep := r.post(t, "/v1/completions", completionBody(fmt.Sprintf("%d %s", i%40, strings.Repeat(pdPrompt, 2)), 4, i%2 == 0))
				ok := rep.status == 200 && (i%2 == 1 || strings.HasSuffix(rep.body, "data: [DONE]\n\n")) && !strings.Contains(rep.body, `"error"`)
				if !ok {
					failed.Add(1)
					errMu.Lock()
					if firstErr == "" {
						firstErr = fmt.Sprintf("request %d: %d %v %s", i, rep.status, rep.header, rep.body)
					}
					errMu.Unlock()
				}
				if rep.header["x-kvmesh-mode"] == "split" {
					split.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if failed.Load() != 0 {
		t.Fatalf("%d of %d failed; first: %s", failed.Load(), total, firstErr)
	}
	t.Logf("%d of %d served split, 0 failed; %s; %s", split.Load(), total, scrape(t, r, "kvmesh_router_prefills_total"), scrape(t, r, "kvmesh_router_retries_total"))
	if m := scrape(t, r, "kvmesh_router_prefills_total"); !strings.Contains(m, `outcome="failed"`) {
		t.Errorf("the killed prefill replica failed no prefill: %s", m)
	}
	if split.Load() < total/2 {
		t.Errorf("only %d of %d split", split.Load(), total)
	}
}

// scrape returns the lines of r's /metrics that name metric.
func scrape(t *testing.T, r *testRouter, metric string) string {
	t.Helper()
	var out []string
	for _, line := range strings.Split(r.get(t, "/metrics").body, "\n") {
		if strings.HasPrefix(line, metric) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}
