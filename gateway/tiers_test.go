package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/enginesim"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gossip"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/sidecar"
	"github.com/kvmesh/kvmesh/tokenize"
)

// TestOffloadedPrefixPredictedAsTheEngineServesIt: an enginesim with a
// small GPU pool and a CPU tier (vLLM's OffloadingConnector), its sidecar
// following the tier. A prompt evicted from the GPU by others but kept in
// host memory is predicted offloaded (X-Kvmesh-Offloaded-Tokens), and the
// tokens the engine reports cached, loaded ones counted, equal the
// router's prediction (X-Kvmesh-Cached-Tokens).
func TestOffloadedPrefixPredictedAsTheEngineServesIt(t *testing.T) {
	const gpuBlocks, cpuBlocks = 48, 1024
	log := zerolog.Nop()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	table := fleet.NewTable(fleet.TableConfig{StaleAfter: 2 * time.Second, DropAfter: 5 * time.Second})
	node, err := gossip.StartRouter(gossip.RouterConfig{Config: gossip.Config{Name: "r1", BindAddr: "127.0.0.1:0", Logger: log}}, table)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = node.Leave(0) })
	addr := strings.TrimPrefix(refusedURL(t), "http://")
	pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://" + addr, ReplayEndpoint: "tcp://127.0.0.1:0", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	sim, err := enginesim.New(enginesim.Config{
		Model: testModel, Tokenizer: tokenize.Builtin{}, Events: pub, Logger: log,
		Engine: engine.Config{BlockSize: 16, KVBlocks: gpuBlocks, CPUBlocks: cpuBlocks, MaxNumSeqs: 8, MaxNumBatchedTokens: 2048, MaxModelLen: 512},
	})
	if err != nil {
		t.Fatal(err)
	}
	go sim.Run(ctx)
	engineURL := listen(t, &fasthttp.Server{Handler: sim.Handler, CloseOnShutdown: true})
	sc, err := sidecar.New(sidecar.Config{
		Name: "e1", EngineURL: engineURL, KVEventsBind: "tcp://" + addr, KVReplay: pub.ReplayEndpoint(),
		Capacity: gpuBlocks, OffloadCapacity: cpuBlocks, ScrapeInterval: 50 * time.Millisecond,
		Gossip: gossip.Config{BindAddr: "127.0.0.1:0", Join: []string{node.Addr()}}, Logger: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- sc.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	waitUntil(t, 20*time.Second, "replica online at the router with its CPU tier", func() bool {
		snap := table.Snapshot()
		i := snap.Find("e1")
		return i >= 0 && snap.Replicas[i].Online && snap.Replicas[i].BlockSize == 16 &&
			len(snap.Replicas[i].OffloadMedia) == 1 && snap.Replicas[i].OffloadMedia[0] == "CPU"
	})
	engine := &testRouter{url: engineURL}
	direct := func(prompt string) {
		t.Helper()
		rep := engine.post(t, "/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, testModel, prompt))
		if rep.status != 200 {
			t.Fatalf("completion at the engine: %d %s", rep.status, rep.body)
		}
	}
	// The publisher dials the sidecar in the background: prime until the
	// sidecar holds blocks.
	for i := 0; sc.Status().ResidentBlocks == 0; i++ {
		if i == 50 {
			t.Fatalf("no blocks resident after %d completions", i)
		}
		direct(fmt.Sprintf("prime %d: %s", i, strings.Repeat("warm up the cache ", 8)))
		time.Sleep(50 * time.Millisecond)
	}
	prompt := strings.Repeat("the offloaded prefix stays in host memory ", 40)
	router := gatewayOn(t, table, Settings{})
	first := completionVia(t, router, prompt)
	// Other prompts, straight at the engine, push it out of the GPU pool;
	// the CPU tier keeps it. The sidecar's next filter generation drops
	// its GPU keys.
	gen := sc.Status().FilterGeneration
	for i := range 6 {
		direct(strings.Repeat(fmt.Sprintf("filler %d takes the GPU pool ", i), 40))
	}
	waitUntil(t, 10*time.Second, "a filter without the evicted GPU blocks at the router", func() bool {
		st := sc.Status()
		snap := table.Snapshot()
		i := snap.Find("e1")
		return st.FilterGeneration > gen && i >= 0 && snap.Replicas[i].FilterGeneration == st.FilterGeneration && snap.Replicas[i].FilterKeys == st.FilterKeys
	})
	rep := (&testRouter{url: router}).post(t, "/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, testModel, prompt))
	if rep.status != 200 {
		t.Fatalf("completion: %d %s", rep.status, rep.body)
	}
	predicted, _ := strconv.Atoi(rep.header["x-kvmesh-cached-tokens"])
	offloaded, _ := strconv.Atoi(rep.header["x-kvmesh-offloaded-tokens"])
	cached := cachedTokensOf(t, rep.body)
	t.Logf("first %+v; after eviction from the GPU: predicted %d cached (%d offloaded), engine reports %d", first, predicted, offloaded, cached)
	if offloaded == 0 || offloaded > predicted || predicted == 0 {
		t.Fatalf("predicted %d cached, %d of them offloaded: want an offloaded prefix", predicted, offloaded)
	}
	if predicted != cached {
		t.Fatalf("predicted %d cached tokens, the engine reports %d", predicted, cached)
	}
	if reps := (&testRouter{url: router}).get(t, "/admin/replicas"); !strings.Contains(reps.body, `"offload_media":["CPU"]`) {
		t.Fatalf("/admin/replicas without the CPU tier: %s", reps.body)
	}
	want := fmt.Sprintf("kvmesh_router_predicted_offloaded_tokens_total %d\n", offloaded)
	if m := (&testRouter{url: router}).get(t, "/metrics"); !strings.Contains(m.body, want) {
		t.Fatalf("metrics without %q", want)
	}
}

// cachedTokensOf reads usage.prompt_tokens_details.cached_tokens.
func cachedTokensOf(t *testing.T, body string) int {
	t.Helper()
	var b struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(body), &b); err != nil {
		t.Fatal(err)
	}
	return b.Usage.Details.Cached
}
