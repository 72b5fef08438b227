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
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/sidecar"
	"github.com/kvmesh/kvmesh/tokenize"
)

// rankSink publishes each batch on the publisher of the rank it is
// stamped with, as every vLLM data-parallel rank has its own socket.
type rankSink []*kvevents.Publisher

func (s rankSink) Publish(b *kvevents.Batch) error { return s[b.DPRank].Publish(b) }

// dpStack is one enginesim of two data-parallel ranks, a sidecar per rank
// and a gossip router member feeding a table.
type dpStack struct {
	engineURL string
	table     *fleet.Table
	sidecars  [2]*sidecar.Sidecar
}

func startDPStack(t *testing.T) *dpStack {
	t.Helper()
	log := zerolog.Nop()
	var pubs rankSink
	// Loopback addresses nothing listens on yet, for the sidecars to bind.
	addrs := [2]string{strings.TrimPrefix(refusedURL(t), "http://"), strings.TrimPrefix(refusedURL(t), "http://")}
	for r := range 2 {
		p, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://" + addrs[r], ReplayEndpoint: "tcp://127.0.0.1:0", Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Close() })
		pubs = append(pubs, p)
	}
	sim, err := enginesim.New(enginesim.Config{
		Model: testModel, Tokenizer: tokenize.Builtin{}, DataParallelSize: 2, Events: pubs, Logger: log,
		Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 64, MaxNumBatchedTokens: 8192, MaxModelLen: 32768},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go sim.Run(ctx)
	st := &dpStack{engineURL: listen(t, &fasthttp.Server{Handler: sim.Handler, CloseOnShutdown: true})}

	st.table = fleet.NewTable(fleet.TableConfig{StaleAfter: 2 * time.Second, DropAfter: 5 * time.Second})
	node, err := gossip.StartRouter(gossip.RouterConfig{Config: gossip.Config{Name: "r1", BindAddr: "127.0.0.1:0", Logger: log}}, st.table)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = node.Leave(0) })
	for r := range 2 {
		sc, err := sidecar.New(sidecar.Config{
			Name: fmt.Sprintf("sim-dp%d", r), EngineURL: st.engineURL, DataParallel: true, DataParallelRank: r,
			KVEventsBind: "tcp://" + addrs[r], KVReplay: pubs[r].ReplayEndpoint(), ScrapeInterval: 50 * time.Millisecond,
			Gossip: gossip.Config{BindAddr: "127.0.0.1:0", Join: []string{node.Addr()}}, Logger: log,
		})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- sc.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-done })
		st.sidecars[r] = sc
	}
	waitUntil(t, 15*time.Second, "both ranks online at the router with their rank and block size", func() bool {
		snap := st.table.Snapshot()
		for r := range 2 {
			i := snap.Find(fmt.Sprintf("sim-dp%d", r))
			if i < 0 || !snap.Replicas[i].Online || !snap.Replicas[i].DataParallel || snap.Replicas[i].DataParallelRank != r ||
				snap.Replicas[i].BlockSize != 16 || snap.Replicas[i].URL != st.engineURL {
				return false
			}
		}
		return true
	})
	// A publisher dials its sidecar in the background, and what it sends
	// before is lost (the next batch's gap is then replayed): prime each
	// rank straight at the engine until its sidecar holds blocks.
	for r := range 2 {
		for i := 0; st.sidecars[r].Status().ResidentBlocks == 0; i++ {
			if i == 50 {
				t.Fatalf("rank %d: no blocks resident after %d completions", r, i)
			}
			engineCompletion(t, st.engineURL, fmt.Sprintf("prime rank %d, try %d: %s", r, i, strings.Repeat("warm up the cache ", 8)), r)
			time.Sleep(50 * time.Millisecond)
		}
	}
	return st
}

// engineCompletion sends a completion straight to the engine's rank.
func engineCompletion(t *testing.T, url, prompt string, rank int) {
	t.Helper()
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url + "/v1/completions")
	req.Header.SetMethod("POST")
	req.Header.Set(proxy.RankHeader, strconv.Itoa(rank))
	req.SetBodyString(fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, testModel, prompt))
	if err := client.DoTimeout(req, resp, 10*time.Second); err != nil || resp.StatusCode() != 200 {
		t.Fatalf("completion at rank %d: %v %d %s", rank, err, resp.StatusCode(), resp.Body())
	}
}

// synced reports whether the router's table holds every sidecar's current
// filter.
func (st *dpStack) synced() bool {
	snap := st.table.Snapshot()
	for r, sc := range st.sidecars {
		s := sc.Status()
		i := snap.Find(fmt.Sprintf("sim-dp%d", r))
		if i < 0 || snap.Replicas[i].FilterGeneration != s.FilterGeneration || snap.Replicas[i].FilterKeys != s.FilterKeys {
			return false
		}
	}
	return true
}

// resident is each rank's resident block count, as its sidecar holds it.
func (st *dpStack) resident() (n [2]int) {
	for r, sc := range st.sidecars {
		n[r] = sc.Status().ResidentBlocks
	}
	return n
}

// gatewayOn serves a gateway over table with s.
func gatewayOn(t *testing.T, table *fleet.Table, s Settings) string {
	t.Helper()
	p, err := routing.New("kvaware", routing.Config{})
	if err != nil {
		t.Fatal(err)
	}
	s.Policy, s.DefaultTokenizer = p, tokenize.Builtin{}
	s.Upstream = proxy.Options{FirstByteTimeout: 10 * time.Second, IdleTimeout: 5 * time.Second}
	return listen(t, New(table, nil, s, zerolog.Nop()).Server(1<<20))
}

// routed is one completion through a router: the replica it chose, the
// cached tokens it predicted, and those the engine reports.
type routed struct {
	replica           string
	predicted, cached int
}

func completionVia(t *testing.T, router, prompt string) routed {
	t.Helper()
	rep := (&testRouter{url: router}).post(t, "/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, testModel, prompt))
	if rep.status != 200 {
		t.Fatalf("completion: %d %s", rep.status, rep.body)
	}
	var body struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(rep.body), &body); err != nil {
		t.Fatal(err)
	}
	predicted, _ := strconv.Atoi(rep.header["x-kvmesh-cached-tokens"])
	return routed{replica: rep.header["x-kvmesh-replica"], predicted: predicted, cached: body.Usage.Details.Cached}
}

// TestDataParallelRanksServeWhatTheRouterPredicted: two sidecars follow
// the two ranks of one enginesim. The router names the rank it chose
// (X-data-parallel-rank), so a repeated prompt is served by the rank that
// holds it and the engine's cached tokens equal the prediction, on both
// ranks. With the header withheld (--no-data-parallel-header) the engine's
// balancer places each request itself: idle, it picks rank 0, and the
// prompts the router predicted on rank 1 find nothing cached.
func TestDataParallelRanksServeWhatTheRouterPredicted(t *testing.T) {
	start := time.Now()
	st := startDPStack(t)
	withHeader := gatewayOn(t, st.table, Settings{})
	withheld := gatewayOn(t, st.table, Settings{NoDataParallelHeader: true})
	t.Logf("stack up in %v", time.Since(start).Round(time.Millisecond))

	// /admin/replicas: each rank with its server (the URL both share).
	var views []struct {
		Name   string `json:"name"`
		Server string `json:"server"`
		Rank   *int   `json:"data_parallel_rank"`
	}
	if err := json.Unmarshal([]byte((&testRouter{url: withHeader}).get(t, "/admin/replicas").body), &views); err != nil || len(views) != 2 {
		t.Fatalf("/admin/replicas: %+v %v", views, err)
	}
	for r, v := range views {
		if v.Name != fmt.Sprintf("sim-dp%d", r) || v.Server != st.engineURL || v.Rank == nil || *v.Rank != r {
			t.Errorf("/admin/replicas[%d]: %s of server %q, rank %v; want sim-dp%d of %q, rank %d", r, v.Name, v.Server, v.Rank, r, st.engineURL, r)
		}
	}

	const prompts = 12
	text := func(i int) string {
		return fmt.Sprintf("conversation %d: %s", i, strings.Repeat(fmt.Sprintf("tenant %d shares a long system prompt with every turn. ", i), 12))
	}
	placed := map[string]int{}
	equal := 0
	for i := range prompts {
		before := st.resident()
		first := completionVia(t, withHeader, text(i))
		rank := strings.TrimPrefix(first.replica, "sim-dp")
		r, err := strconv.Atoi(rank)
		if err != nil || r < 0 || r > 1 {
			t.Fatalf("prompt %d served by %q", i, first.replica)
		}
		waitUntil(t, 5*time.Second, "the router holds the served rank's new blocks", func() bool {
			return st.sidecars[r].Status().ResidentBlocks > before[r] && st.synced()
		})
		again := completionVia(t, withHeader, text(i))
		if again.replica != first.replica || again.predicted == 0 || again.predicted != again.cached {
			t.Errorf("prompt %d: first at %s, repeat at %s predicted %d cached %d; want the same rank with predicted == cached > 0",
				i, first.replica, again.replica, again.predicted, again.cached)
		}
		if again.predicted == again.cached {
			equal++
		}
		placed[first.replica]++
	}
	t.Logf("header sent: predicted == engine cached on %d/%d repeats; prompts per rank %v", equal, prompts, placed)
	if placed["sim-dp0"] == 0 || placed["sim-dp1"] == 0 {
		t.Fatalf("prompts per rank %v: both ranks must hold some for the test to tell ranks apart", placed)
	}

	// Header withheld: the same prompts, spaced past the balancer's
	// 100 ms refresh so that it sees both ranks idle and picks rank 0.
	misses := 0
	for i := range prompts {
		time.Sleep(150 * time.Millisecond)
		r := completionVia(t, withheld, text(i))
		if r.predicted != r.cached {
			misses++
			if r.replica != "sim-dp1" || r.cached != 0 {
				t.Errorf("prompt %d without the header: predicted %d at %s, engine cached %d", i, r.predicted, r.replica, r.cached)
			}
		}
	}
	t.Logf("header withheld: predicted != engine cached on %d/%d requests (the router's choice was rank 1 on %d)", misses, prompts, placed["sim-dp1"])
	if misses != placed["sim-dp1"] {
		t.Errorf("%d mispredicted without the header, want the %d prompts held by rank 1", misses, placed["sim-dp1"])
	}
	t.Logf("test took %v", time.Since(start).Round(time.Millisecond))
}
