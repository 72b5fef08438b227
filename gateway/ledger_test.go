package gateway

import (
	"encoding/json"
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

// TestLedgerAccountsEveryAttempt drives a ledger as the proxy would,
// without sockets: each attempt raises its replica's in-flight work until
// it ends, a replica that did not answer is ejected, the policy learns only
// from a stream measured at its pick on the first try, and End leaves
// nothing in flight.
func TestLedgerAccountsEveryAttempt(t *testing.T) {
	p, err := routing.New("kvaware", routing.Config{})
	if err != nil {
		t.Fatal(err)
	}
	rec := &learnRecorder{kvawareLike: p.(kvawareLike)}
	table := fleet.NewTable(fleet.TableConfig{StaleAfter: time.Hour, DropAfter: time.Hour})
	now := time.Now()
	prompt := strings.Repeat("A preamble that only replica a holds. ", 40)
	ids, _ := tokenize.Builtin{}.Encode(prompt, true)
	keys := blockkey.Append(nil, blockkey.Seed("", ""), ids, 16)
	for _, n := range []string{"a", "b"} {
		table.Upsert(fleet.Info{Name: n, Models: []string{testModel}, URL: "http://127.0.0.1:1", Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
		table.SetLoad(n, fleet.Load{}, true, now)
		f := bloom.NewFilter(1024, 0.001)
		if n == "a" {
			for _, k := range keys {
				f.Add(k)
			}
		}
		table.SetFilter(n, f, 1, len(keys), now)
	}
	g := New(table, nil, Settings{Policy: rec, DefaultTokenizer: tokenize.Builtin{}}, zerolog.Nop())
	body, _ := json.Marshal(map[string]any{"model": testModel, "stream": true, "prompt": prompt})
	req, err := request.Parse(body, request.Completion)
	if err != nil {
		t.Fatal(err)
	}
	inflight := func(name string) (int64, int64) {
		l := g.inflight.get(name)
		return l.requests.Load(), l.prefill.Load()
	}
	decide := func() *ledger {
		l := g.newLedger(g.Settings())
		l.model, l.measuresTTFT = testModel, true
		if err := l.decide(table.Snapshot(), req); err != nil {
			t.Fatal(err)
		}
		if len(l.targets) != 2 || l.plan.Targets[0].Name != "a" || !l.plan.Targets[0].Teaches || l.targets[0].Name != "a" {
			t.Fatalf("targets %+v", l.plan.Targets)
		}
		return l
	}

	// Refused at a, served by b: a is ejected, nothing is learned (b was
	// not the pick), and both replicas' counts return to zero.
	l := decide()
	uncached := int64(l.plan.Targets[0].Uncached)
	l.Attempt(0)
	if r, pf := inflight("a"); r != 1 || pf != uncached {
		t.Fatalf("a in flight: %d requests, %d prefill; want 1, %d", r, pf, uncached)
	}
	l.Retry(0, proxy.Result{Err: syscall.ECONNREFUSED, Retried: true, PromptTokens: -1, CachedTokens: -1})
	l.Attempt(1)
	l.FirstByte(1, 20*time.Millisecond)
	if r, pf := inflight("b"); r != 1 || pf != 0 {
		t.Fatalf("b in flight after its first byte: %d requests, %d prefill; want 1, 0", r, pf)
	}
	l.End(proxy.Result{Status: 200, Events: 3, PromptTokens: -1, CachedTokens: -1})
	for _, n := range []string{"a", "b"} {
		if r, pf := inflight(n); r != 0 || pf != 0 {
			t.Errorf("%s left in flight: %d requests, %d prefill", n, r, pf)
		}
	}
	if !g.inflight.get("a").eject.out(g.now().UnixNano()) {
		t.Error("a refused the connection and was not ejected")
	}
	if len(rec.learned) != 0 {
		t.Fatalf("learned %+v from a retried request", rec.learned)
	}

	// Served by the pick on the first try: one observation, with the
	// engine's cached count.
	g.inflight.get("a").eject.reached()
	l = decide()
	l.Attempt(0)
	l.FirstByte(0, 30*time.Millisecond)
	l.End(proxy.Result{Status: 200, Events: 5, PromptTokens: len(ids), CachedTokens: 64})
	if len(rec.learned) != 1 || rec.learned[0].replica != "a" || rec.learned[0].cachedTokens != 64 || rec.learned[0].ttft != 30*time.Millisecond {
		t.Fatalf("learned %+v", rec.learned)
	}
	if r, pf := inflight("a"); r != 0 || pf != 0 {
		t.Errorf("a left in flight: %d requests, %d prefill", r, pf)
	}

	// A panic's End (the router's failure) closes the open attempt too.
	l = decide()
	l.Attempt(0)
	l.End(proxy.Result{Err: errors.New("boom"), Internal: true, PromptTokens: -1, CachedTokens: -1})
	if r, pf := inflight("a"); r != 0 || pf != 0 || g.inflight.get("a").eject.out(g.now().UnixNano()) {
		t.Errorf("after an internal failure: %d requests, %d prefill in flight, ejected %v", r, pf, g.inflight.get("a").eject.out(g.now().UnixNano()))
	}
}
