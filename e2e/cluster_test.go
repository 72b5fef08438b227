package e2e

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestCluster brings the demo cluster up once and runs the fault scenarios
// on it in an order where each leaves the cluster usable for the next (each
// uses its own prompts): the kill comes last.
func TestCluster(t *testing.T) {
	s := up(t)
	for _, tc := range []struct {
		name string
		run  func(*testing.T, *stack)
	}{
		{"CrossRouterPrefixHit", testCrossRouterPrefixHit},
		{"PrimeEngines", primeEngines},
		{"RouterPartition", testRouterPartition},
		{"EngineRestart", testEngineRestart},
		{"LateRouter", testLateRouter},
		{"KillEngineUnderLoad", testKillEngineUnderLoad},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.run(t, s.with(t)) })
	}
}

// primeEngines sends one chat straight to each engine, so every sidecar has
// seen an event and announced its block size before the fault scenarios run.
// The engines want their API key (a call without it is refused), so every
// request the routers served also proves they send it.
// CrossRouterPrefixHit runs before this on purpose: it covers a replica's very
// first event, when the block size it learns changes the sidecar's metadata.
// (Routers drop a replica's filter when its announced block size changes and
// get it back by a resync; warm waits for that.)
func primeEngines(t *testing.T, s *stack) {
	for i := 1; i <= replicas; i++ {
		svc := fmt.Sprintf("replica%d", i)
		if r, err := chat("http://"+s.port(svc, "8000"), conversation("prime-"+svc), 2); err != nil || r.Status != 401 {
			t.Fatalf("chat straight to %s's engine without its API key: %v %d %s, want 401", svc, err, r.Status, r.Body)
		}
		if r, err := chatWithKey("http://"+s.port(svc, "8000"), engineAPIKey, conversation("prime-"+svc), 2); err != nil || r.Status != 200 {
			t.Fatalf("chat straight to %s's engine: %v %d %s", svc, err, r.Status, r.Body)
		}
		if _, ok := eventually(3*time.Second, func() bool { return s.sidecarStatus(svc).BlockSize == 16 }); !ok {
			t.Fatalf("%s sidecar did not learn the block size", svc)
		}
	}
	time.Sleep(time.Second) // metadata gossip settles
}

// warm sends a fresh conversation through router and waits until the given
// routers see a filter with keys for the replica that served it, under the
// block size the sidecar announced (a replica's first event announces it;
// until that metadata arrives a router may still drop the filter). It
// returns the conversation and the answer.
func warm(t *testing.T, s *stack, router, seed string, routers ...string) ([]message, chatResult) {
	t.Helper()
	msgs := conversation(seed)
	r, err := chat(s.routers[router], msgs, 8)
	if err != nil || r.Status != 200 {
		t.Fatalf("warm-up chat via %s: %v %d %s", router, err, r.Status, r.Body)
	}
	// Each router must see the blocks, and no longer see the warm-up's own
	// load: load records lag the engine by up to two reads, and a follow-up
	// sent at once (not seconds later, as a user's next turn) would weigh a
	// queue of one that has already gone, 30 ms against 8 ms of prefill saved.
	for _, rt := range routers {
		if took, ok := eventually(3*time.Second, func() bool {
			v := s.replicas(rt)[r.Replica]
			return v.BlockSize > 0 && v.FilterKeys > 0 && v.Waiting == 0 && v.Running == 0 && v.ClusterInflight == 0
		}); !ok {
			// What each side believed, for the next reader of a failure.
			t.Fatalf("%s: no filter keys for %s, or its load not idle, %v after the warm-up; the router's view %+v, the sidecar's %+v",
				rt, r.Replica, took, s.replicas(rt)[r.Replica], s.sidecarStatus(r.Replica))
		}
	}
	return msgs, r
}

// Chat through router 1, then the same prefix through router 2: the second
// router sends it to the same replica, predicts the hit and the engine
// confirms it.
func testCrossRouterPrefixHit(t *testing.T, s *stack) {
	msgs, first := warm(t, s, "router1", "cross-router", "router2")
	t.Logf("router1 → %s mode=%s prompt=%d", first.Replica, first.Mode, first.PromptTokens)

	second, err := chat(s.routers["router2"], followUp(msgs, first.Content, "And now?"), 8)
	if err != nil || second.Status != 200 {
		t.Fatalf("chat via router2: %v %d %s", err, second.Status, second.Body)
	}
	t.Logf("router2 → %s mode=%s prompt=%d predicted=%d engine=%d",
		second.Replica, second.Mode, second.PromptTokens, second.PredictedCached, second.EngineCached)
	if second.Replica != first.Replica || second.Mode != "prefix" {
		t.Logf("router2's view after the request: %+v", s.replicas("router2"))
	}
	if second.Replica != first.Replica {
		t.Errorf("router2 chose %s, the prefix lives on %s", second.Replica, first.Replica)
	}
	if second.Mode != "prefix" {
		t.Errorf("X-Kvmesh-Mode = %q, want prefix", second.Mode)
	}
	// Every full block of the first prompt is resident.
	wantMin := first.PromptTokens / 16 * 16
	if second.PredictedCached < wantMin-16 || second.PredictedCached == 0 {
		t.Errorf("X-Kvmesh-Cached-Tokens = %d, want about %d (the first prompt's full blocks)", second.PredictedCached, wantMin)
	}
	if second.EngineCached == 0 {
		t.Errorf("engine usage cached_tokens = 0")
	}
	if second.PredictedCached > second.EngineCached {
		t.Errorf("router predicted %d cached tokens, the engine had %d: a prediction must not overclaim",
			second.PredictedCached, second.EngineCached)
	}
}

// load runs workers sending chats alternately through both routers until
// stop is closed, non-streamed ones and streamed ones, and counts results.
type load struct {
	chats, streams tally
	mu             sync.Mutex
	failures       []string
	wg             sync.WaitGroup
	stop           chan struct{}
	bases          []string
}

// tally counts one kind of request; by (under load.mu) counts successes by
// the replica that served them.
type tally struct {
	ok, failed atomic.Int64
	by         map[string]int
}

// streamTokens is each streamed chat's max_tokens: enginesim always
// generates exactly that many, so a stream taken over by another replica
// must still add up to it.
const streamTokens = 160

// longStreamTokens is the stream whose engine is killed under it: long
// enough to outlast the kill (enginesim runs 10× faster than real time).
const longStreamTokens = 4000

func startLoad(s *stack, workers int) *load {
	l := &load{stop: make(chan struct{}), bases: []string{s.routers["router1"], s.routers["router2"]},
		chats: tally{by: map[string]int{}}, streams: tally{by: map[string]int{}}}
	l.run(workers, &l.chats, "Question", func(base string, msgs []message) (string, error) {
		r, err := chat(base, msgs, 16)
		if err == nil && r.Status != 200 {
			err = fmt.Errorf("status %d %s", r.Status, strings.TrimSpace(r.Body))
		}
		return r.Replica, err
	})
	return l
}

func (l *load) startStreams(streamers int) {
	l.run(streamers, &l.streams, "Stream", func(base string, msgs []message) (string, error) {
		n, replica, err := streamChat(base, msgs, streamTokens)
		if err == nil && n != streamTokens {
			err = fmt.Errorf("stream: %d text chunks, want %d", n, streamTokens)
		} else if err != nil {
			err = fmt.Errorf("stream: %w", err)
		}
		return replica, err
	})
}

// run starts n workers sending, until stop, fresh questions (named by what)
// on a handful of shared prefixes, so the kvaware policy has cached work
// to route to; send answers the replica that served or an error.
func (l *load) run(n int, t *tally, what string, send func(base string, msgs []message) (string, error)) {
	for w := 0; w < n; w++ {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				msgs := conversation(fmt.Sprintf("load-%d", (w+i)%6))
				msgs[1].Content = fmt.Sprintf("%s %d of worker %d?", what, i, w)
				replica, err := send(l.bases[(w+i)%2], msgs)
				l.mu.Lock()
				if err != nil {
					t.failed.Add(1)
					if len(l.failures) < 10 {
						l.failures = append(l.failures, err.Error())
					}
				} else {
					t.ok.Add(1)
					t.by[replica]++
				}
				l.mu.Unlock()
			}
		}()
	}
}

func (l *load) finish() {
	close(l.stop)
	l.wg.Wait()
}

// docker kill one engine under steady load, two tokens into a long stream
// it serves: no request fails, streamed or not (the routers run with
// --resume-streams: the long stream goes on at another replica and still
// adds up to its max_tokens), the replica leaves routing on both routers
// within 2 s and its route records are cleared.
func testKillEngineUnderLoad(t *testing.T, s *stack) {
	// Engine processes first: docker-compose ps can take seconds under load,
	// and so can `docker kill` on a busy host, while the long stream runs on.
	engines := map[string]engineProcess{}
	for i := 1; i <= replicas; i++ {
		engines[fmt.Sprintf("replica%d", i)] = s.engineProcess(fmt.Sprintf("engine%d", i))
	}
	l := startLoad(s, 8)
	l.startStreams(4)
	defer func() {
		select {
		case <-l.stop:
		default:
			l.finish()
		}
	}()
	time.Sleep(3 * time.Second)
	// Kill the replica serving a long stream, once its first tokens arrived.
	victim, body, err := startStream(s.routers["router1"], conversation("long-stream"), longStreamTokens)
	if err != nil {
		t.Fatalf("long stream: %v", err)
	}
	defer body.Close()
	stream := bufio.NewReader(body)
	var seen strings.Builder
	for tokens := 0; tokens < 2; {
		line, err := stream.ReadString('\n')
		if err != nil {
			t.Fatalf("long stream: %v after %q", err, seen.String())
		}
		seen.WriteString(line)
		if strings.Contains(line, `"content":"`) && !strings.Contains(line, `"content":""`) {
			tokens++
		}
	}
	secondToken := time.Now()
	before := l.chats.ok.Load()
	s.kill(engines[victim])
	killed := time.Now()
	t.Logf("killed %s's engine %v after its stream's second token", victim, killed.Sub(secondToken).Round(time.Millisecond))
	longDone := make(chan error, 1)
	go func() {
		n, err := readStream(io.MultiReader(strings.NewReader(seen.String()), stream))
		if err == nil && n != longStreamTokens {
			err = fmt.Errorf("%d text chunks, want %d", n, longStreamTokens)
		}
		if err == nil {
			t.Logf("the long stream ended %v after the kill", time.Since(killed).Round(time.Millisecond))
		}
		longDone <- err
	}()

	gone := func(rt string) func() bool {
		return func() bool {
			r, listed := s.replicas(rt)[victim]
			return !listed || (!r.Online && r.FilterKeys == 0 && r.FilterGeneration == 0)
		}
	}
	for _, rt := range []string{"router1", "router2"} {
		took, ok := eventually(2*time.Second-time.Since(killed), gone(rt))
		took = time.Since(killed)
		if !ok {
			t.Errorf("%s still lists %s as %+v %v after the kill", rt, victim, s.replicas(rt)[victim], took)
		} else {
			t.Logf("%s: %s out of routing, route records cleared, %v after the kill", rt, victim, took.Round(time.Millisecond))
		}
	}
	time.Sleep(3 * time.Second)
	l.finish()
	l.mu.Lock()
	defer l.mu.Unlock()
	t.Logf("load: %d ok (%d after the kill), %d failed; by replica %v; streams %d ok (started on %v), %d failed; taken over by another replica: %s",
		l.chats.ok.Load(), l.chats.ok.Load()-before, l.chats.failed.Load(), l.chats.by, l.streams.ok.Load(), l.streams.by, l.streams.failed.Load(), s.resumedStreams())
	if n := l.chats.failed.Load() + l.streams.failed.Load(); n != 0 {
		t.Errorf("%d requests failed (%d streamed); first: %q", n, l.streams.failed.Load(), l.failures)
	}
	if l.streams.ok.Load() == 0 {
		t.Errorf("no streamed request completed")
	}
	if err := <-longDone; err != nil {
		t.Errorf("the long stream on %s did not survive its engine: %v", victim, err)
	}
	if !strings.Contains(s.resumedStreams(), "router1=") || strings.Contains(s.resumedStreams(), "router1=0") {
		t.Errorf("router1 took over no stream: %s", s.resumedStreams())
	}
	if l.chats.ok.Load()-before < 20 {
		t.Errorf("only %d requests succeeded after the kill: the load did not go on", l.chats.ok.Load()-before)
	}
}

// Cut router2 off the gossip network: it keeps serving on its last state and
// flags that state stale; reconnected, it converges to the filter
// generations router1 sees.
func testRouterPartition(t *testing.T, s *stack) {
	for i := 0; i < 4; i++ {
		warm(t, s, "router1", fmt.Sprintf("partition-%d", i), "router1", "router2")
	}
	r2 := s.container("router2")
	network := s.project + "_mesh"
	ip := s.prefix + ".22"
	s.docker("network", "disconnect", network, r2)
	cut := time.Now()
	reconnected := false
	defer func() {
		if !reconnected {
			s.docker("network", "connect", "--ip", ip, network, r2)
		}
	}()

	took, ok := eventually(3*time.Second, func() bool {
		for _, r := range s.replicas("router2") {
			if !r.Stale {
				return false
			}
		}
		return true
	})
	if !ok {
		t.Errorf("router2 did not flag its state stale within %v: %+v", took, s.replicas("router2"))
	} else {
		t.Logf("router2 flagged every replica stale %v after the cut", time.Since(cut).Round(time.Millisecond))
	}
	// Still serving, on what it last knew (load only: stale state degrades
	// confidence, never correctness).
	for i := 0; i < 5; i++ {
		r, err := chat(s.routers["router2"], conversation(fmt.Sprintf("partition-%d", i%4)), 4)
		if err != nil || r.Status != 200 {
			t.Errorf("router2 cut off, request %d: %v %d %s", i, err, r.Status, strings.TrimSpace(r.Body))
			break
		}
	}
	// While router2 is away the sidecars rebuild (new generations) and learn
	// new prefixes through router1.
	req, _ := http.NewRequest("POST", s.routers["router1"]+"/admin/routes/clear", strings.NewReader("{}"))
	req.Header.Set("Authorization", "Bearer kvmesh-demo-admin")
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("routes/clear via router1: %v %v", err, resp)
	}
	resp.Body.Close()
	for i := 0; i < 4; i++ {
		warm(t, s, "router1", fmt.Sprintf("partition-new-%d", i), "router1")
	}
	time.Sleep(time.Second)

	s.docker("network", "connect", "--ip", ip, network, r2)
	reconnected = true
	back := time.Now()
	converged := func() bool {
		a, b := s.replicas("router1"), s.replicas("router2")
		if len(a) != replicas || len(b) != replicas {
			return false
		}
		for name, ra := range a {
			rb := b[name]
			if !rb.Online || rb.Stale || rb.FilterGeneration != ra.FilterGeneration || rb.FilterKeys != ra.FilterKeys {
				return false
			}
		}
		return true
	}
	if took, ok := eventually(15*time.Second, converged); !ok {
		t.Errorf("router2 not converged %v after reconnecting:\nrouter1 %+v\nrouter2 %+v", took, s.replicas("router1"), s.replicas("router2"))
	} else {
		t.Logf("router2 converged to router1's generations %v after reconnecting (%v cut off)",
			took.Round(time.Millisecond), back.Sub(cut).Round(time.Millisecond))
	}
}

// Restart an engine: its sidecar sees the new engine, drops what the old one
// held and rebuilds; the routers follow, and nothing predicts a hit on the
// blocks the restart lost.
func testEngineRestart(t *testing.T, s *stack) {
	msgs, first := warm(t, s, "router1", "restart", "router1", "router2")
	victim := first.Replica
	before := s.sidecarStatus(victim)
	if before.ResidentBlocks == 0 {
		t.Fatalf("%s holds no blocks after the warm-up: %+v", victim, before)
	}
	engine := "engine" + strings.TrimPrefix(victim, "replica")
	s.docker("restart", "--time", "1", s.container(engine))

	var after sidecarStatus
	took, ok := eventually(10*time.Second, func() bool {
		after = s.sidecarStatus(victim)
		return after.EngineHealthy && after.Connected && after.FilterGeneration > before.FilterGeneration && after.ResidentBlocks == 0
	})
	if !ok {
		t.Fatalf("%s sidecar did not rebuild after the engine restart (%v): before %+v after %+v", victim, took, before, after)
	}
	t.Logf("%s sidecar rebuilt %v after the restart: generation %d → %d, resident %d → %d, resets %d",
		victim, took.Round(time.Millisecond), before.FilterGeneration, after.FilterGeneration,
		before.ResidentBlocks, after.ResidentBlocks, after.EngineResets)
	for _, rt := range []string{"router1", "router2"} {
		if _, ok := eventually(3*time.Second, func() bool {
			r := s.replicas(rt)[victim]
			return r.Online && r.FilterGeneration >= after.FilterGeneration && r.FilterKeys == 0
		}); !ok {
			t.Errorf("%s did not follow %s's rebuild: %+v (sidecar generation %d)", rt, victim, s.replicas(rt)[victim], after.FilterGeneration)
		}
	}
	// The old prefix: no router may predict it cached anywhere now.
	for _, rt := range []string{"router1", "router2"} {
		r, err := chat(s.routers[rt], followUp(msgs, first.Content, "After the restart?"), 4)
		if err != nil || r.Status != 200 {
			t.Fatalf("chat via %s after the restart: %v %d %s", rt, err, r.Status, r.Body)
		}
		t.Logf("%s after restart → %s mode=%s predicted=%d engine=%d", rt, r.Replica, r.Mode, r.PredictedCached, r.EngineCached)
		if rt == "router1" && r.PredictedCached != 0 {
			t.Errorf("%s predicted %d cached tokens for a prefix the restart lost (stale resident blocks)", rt, r.PredictedCached)
		}
		if r.PredictedCached > r.EngineCached {
			t.Errorf("%s predicted %d cached tokens, the engine had %d", rt, r.PredictedCached, r.EngineCached)
		}
	}
}

// A router started after the cluster has warmed up catches up from the
// sidecars' snapshots before it serves: its first request on a warm prefix
// is a prefix route to the replica holding it.
func testLateRouter(t *testing.T, s *stack) {
	s.removeRouter("router2")
	var convs [][]message
	var firsts []chatResult
	for i := 0; i < 3; i++ {
		m, r := warm(t, s, "router1", fmt.Sprintf("late-%d", i), "router1")
		convs, firsts = append(convs, m), append(firsts, r)
	}
	start := time.Now()
	s.startRouter("router2")
	t.Logf("router2 ready %v after start", time.Since(start).Round(time.Millisecond))
	for i := range convs {
		r, err := chat(s.routers["router2"], followUp(convs[i], firsts[i].Content, "Late question?"), 4)
		if err != nil || r.Status != 200 {
			t.Fatalf("chat via late router2: %v %d %s", err, r.Status, r.Body)
		}
		t.Logf("late router2 request %d → %s mode=%s predicted=%d engine=%d", i, r.Replica, r.Mode, r.PredictedCached, r.EngineCached)
		if r.Replica != firsts[i].Replica || r.Mode != "prefix" || r.PredictedCached == 0 {
			t.Errorf("late router2 request %d: %s mode %s predicted %d; the prefix lives on %s",
				i, r.Replica, r.Mode, r.PredictedCached, firsts[i].Replica)
		}
	}
	// Both routers hold the same filter generations. Polled (bounded): on a
	// slow network gossip may suspect a sidecar and re-add it meanwhile,
	// and a re-added replica is at generation 0 until its next snapshot.
	deadline := time.Now().Add(3 * time.Second)
	for {
		var differ []string
		a, b := s.replicas("router1"), s.replicas("router2")
		for name, ra := range a {
			if rb := b[name]; rb.FilterGeneration != ra.FilterGeneration {
				differ = append(differ, fmt.Sprintf("%s: router2 holds generation %d, router1 %d", name, rb.FilterGeneration, ra.FilterGeneration))
			}
		}
		if len(differ) == 0 {
			break
		}
		if time.Now().After(deadline) {
			for _, d := range differ {
				t.Error(d)
			}
			break
		}
		t.Logf("generations differ, polling: %v", differ)
		time.Sleep(200 * time.Millisecond)
	}
}
