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

// dpRank is one data-parallel rank of a server, followed by a sidecar.
type dpRank struct {
	name, server string // replica name, server URL
	rank         int
	sc           *sidecar.Sidecar
}

// dpStack is enginesims of several data-parallel ranks each, a sidecar
// per rank and a gossip router member feeding a table.
type dpStack struct {
	table *fleet.Table
	ranks []dpRank // in name order, as the table lists them
}

func startDPStack(t *testing.T, servers, ranks int) *dpStack {
	t.Helper()
	log := zerolog.Nop()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st := &dpStack{table: fleet.NewTable(fleet.TableConfig{StaleAfter: 2 * time.Second, DropAfter: 5 * time.Second})}
	node, err := gossip.StartRouter(gossip.RouterConfig{Config: gossip.Config{Name: "r1", BindAddr: "127.0.0.1:0", Logger: log}}, st.table)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = node.Leave(0) })
	for s := range servers {
		var pubs rankSink
		var addrs []string // loopback addresses nothing listens on yet, for the sidecars to bind
		for range ranks {
			addr := strings.TrimPrefix(refusedURL(t), "http://")
			p, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://" + addr, ReplayEndpoint: "tcp://127.0.0.1:0", Logger: log})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Close() })
			pubs, addrs = append(pubs, p), append(addrs, addr)
		}
		sim, err := enginesim.New(enginesim.Config{
			Model: testModel, Tokenizer: tokenize.Builtin{}, DataParallelSize: ranks, Events: pubs, Logger: log,
			Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 64, MaxNumBatchedTokens: 8192, MaxModelLen: 32768},
		})
		if err != nil {
			t.Fatal(err)
		}
		go sim.Run(ctx)
		url := listen(t, &fasthttp.Server{Handler: sim.Handler, CloseOnShutdown: true})
		for r := range ranks {
			name := fmt.Sprintf("s%d-dp%d", s, r)
			sc, err := sidecar.New(sidecar.Config{
				Name: name, EngineURL: url, DataParallel: true, DataParallelRank: r,
				KVEventsBind: "tcp://" + addrs[r], KVReplay: pubs[r].ReplayEndpoint(), ScrapeInterval: 50 * time.Millisecond,
				Gossip: gossip.Config{BindAddr: "127.0.0.1:0", Join: []string{node.Addr()}}, Logger: log,
			})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- sc.Run(ctx) }()
			t.Cleanup(func() { cancel(); <-done })
			st.ranks = append(st.ranks, dpRank{name: name, server: url, rank: r, sc: sc})
		}
	}
	waitUntil(t, 20*time.Second, "every rank online at the router with its server, rank and block size", func() bool {
		snap := st.table.Snapshot()
		for _, d := range st.ranks {
			i := snap.Find(d.name)
			if i < 0 || !snap.Replicas[i].Online || !snap.Replicas[i].DataParallel || snap.Replicas[i].DataParallelRank != d.rank ||
				snap.Replicas[i].BlockSize != 16 || snap.Replicas[i].URL != d.server {
				return false
			}
		}
		return true
	})
	// A publisher dials its sidecar in the background, and what it sends
	// before is lost (the next batch's gap is then replayed): prime each
	// rank straight at its engine until its sidecar holds blocks.
	for _, d := range st.ranks {
		for i := 0; d.sc.Status().ResidentBlocks == 0; i++ {
			if i == 50 {
				t.Fatalf("%s: no blocks resident after %d completions", d.name, i)
			}
			engineCompletion(t, d.server, fmt.Sprintf("prime %s, try %d: %s", d.name, i, strings.Repeat("warm up the cache ", 8)), d.rank)
			time.Sleep(50 * time.Millisecond)
		}
	}
	return st
}

// find returns the rank named name, or nil.
func (st *dpStack) find(name string) *dpRank {
	for i := range st.ranks {
		if st.ranks[i].name == name {
			return &st.ranks[i]
		}
	}
	return nil
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
	for _, d := range st.ranks {
		s := d.sc.Status()
		i := snap.Find(d.name)
		if i < 0 || snap.Replicas[i].FilterGeneration != s.FilterGeneration || snap.Replicas[i].FilterKeys != s.FilterKeys {
			return false
		}
	}
	return true
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
	predicted, _ := strconv.Atoi(rep.header["x-kvmesh-cached-tokens"])
	return routed{replica: rep.header["x-kvmesh-replica"], predicted: predicted, cached: cachedTokensOf(t, rep.body)}
}

// TestDataParallelRanksServeWhatTheRouterPredicted: a sidecar follows
// each data-parallel rank of enginesims. The router names the rank it
// chose (X-data-parallel-rank), so a repeated prompt is served by the rank
// that holds it and the engine's cached tokens equal the prediction, on
// every rank. With the header withheld (--no-data-parallel-header) each
// engine's balancer places requests itself: idle, it picks rank 0, and the
// prompts the router predicted on another rank find nothing cached.
func TestDataParallelRanksServeWhatTheRouterPredicted(t *testing.T) {
	for _, c := range []struct{ servers, ranks, prompts int }{{1, 2, 12}, {2, 4, 24}} {
		t.Run(fmt.Sprintf("%dx%d", c.servers, c.ranks), func(t *testing.T) {
			testDataParallel(t, c.servers, c.ranks, c.prompts)
		})
	}
}

func testDataParallel(t *testing.T, servers, ranks, prompts int) {
	start := time.Now()
	st := startDPStack(t, servers, ranks)
	withHeader := gatewayOn(t, st.table, Settings{})
	withheld := gatewayOn(t, st.table, Settings{NoDataParallelHeader: true})
	t.Logf("stack of %d servers × %d ranks up in %v", servers, ranks, time.Since(start).Round(time.Millisecond))

	// /admin/replicas: each rank with its server (the URL its ranks share).
	var views []struct {
		Name   string `json:"name"`
		Server string `json:"server"`
		Rank   *int   `json:"data_parallel_rank"`
	}
	if err := json.Unmarshal([]byte((&testRouter{url: withHeader}).get(t, "/admin/replicas").body), &views); err != nil || len(views) != len(st.ranks) {
		t.Fatalf("/admin/replicas: %+v %v", views, err)
	}
	for i, v := range views {
		d := st.ranks[i]
		if v.Name != d.name || v.Server != d.server || v.Rank == nil || *v.Rank != d.rank {
			t.Errorf("/admin/replicas[%d]: %s of server %q, rank %v; want %s of %q, rank %d", i, v.Name, v.Server, v.Rank, d.name, d.server, d.rank)
		}
	}

	text := func(i int) string {
		return fmt.Sprintf("conversation %d: %s", i, strings.Repeat(fmt.Sprintf("tenant %d shares a long system prompt with every turn. ", i), 12))
	}
	placed := map[string]int{}
	offRankZero, equal := 0, 0
	for i := range prompts {
		d0 := map[string]int{}
		for _, d := range st.ranks {
			d0[d.name] = d.sc.Status().ResidentBlocks
		}
		first := completionVia(t, withHeader, text(i))
		d := st.find(first.replica)
		if d == nil {
			t.Fatalf("prompt %d served by %q", i, first.replica)
		}
		waitUntil(t, 10*time.Second, "the router holding the served rank's new blocks", func() bool {
			return d.sc.Status().ResidentBlocks > d0[d.name] && st.synced()
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
		if d.rank != 0 {
			offRankZero++
		}
	}
	t.Logf("header sent: predicted == engine cached on %d/%d repeats; prompts per rank %v", equal, prompts, placed)
	if offRankZero == 0 || offRankZero == prompts {
		t.Fatalf("prompts per rank %v: rank 0 and the others must hold some for the test to tell ranks apart", placed)
	}

	// Header withheld: the same prompts, spaced past the balancer's
	// 100 ms refresh so that it sees every rank idle and picks rank 0.
	misses := 0
	for i := range prompts {
		time.Sleep(150 * time.Millisecond)
		r := completionVia(t, withheld, text(i))
		if r.predicted != r.cached {
			misses++
			if d := st.find(r.replica); d == nil || d.rank == 0 || r.cached != 0 {
				t.Errorf("prompt %d without the header: predicted %d at %s, engine cached %d", i, r.predicted, r.replica, r.cached)
			}
		}
	}
	t.Logf("header withheld: predicted != engine cached on %d/%d requests (the router's choice was not rank 0 on %d)", misses, prompts, offRankZero)
	if misses != offRankZero {
		t.Errorf("%d mispredicted without the header, want the %d prompts held off rank 0", misses, offRankZero)
	}
	t.Logf("test took %v", time.Since(start).Round(time.Millisecond))
}
