package filterstream

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
)

// The scripted cluster below runs Senders and Receivers against each other
// on plain values: the network is a queue of encoded messages, time moves
// only when a script says so, and faults (loss, reordering, duplication)
// are chosen per message by the script, deterministically.

type simSidecar struct {
	member string
	meta   Meta
	s      *Sender
	g      *bloom.Generations
	engine Load
	keys   []uint64 // resident, in the order added
}

type simRouter struct {
	member string
	meta   Meta
	r      *Receiver
	tb     *fleet.Table
	// clears counts route clears heard from other routers.
	clears int
}

// packet is one message in flight, encoded as on the wire.
type packet struct {
	from, to string
	wire     []byte
	kind     Kind
	reliable bool
}

// verdict is what the network does with one packet: how many copies it
// delivers (0 loses it, 2 duplicates it).
type verdict = int

type cluster struct {
	t        *testing.T
	now      time.Time
	sidecars map[string]*simSidecar
	routers  map[string]*simRouter
	queue    []packet
	// fault, when set, decides each packet's fate as it is delivered.
	fault func(p packet) verdict
	// delivered counts the packets handed to a member, by kind.
	delivered map[Kind]int
	resends   int
	resyncs   int
}

func newCluster(t *testing.T) *cluster {
	return &cluster{t: t, now: time.Unix(1_900_000_000, 0), sidecars: map[string]*simSidecar{},
		routers: map[string]*simRouter{}, delivered: map[Kind]int{}}
}

// addRouter starts router name (table and receiver empty) and has it meet
// every member already running.
func (c *cluster) addRouter(name string) *simRouter {
	return c.addRouterAs(Meta{Role: RoleRouter, Name: name, SchemeVersion: blockkey.SchemeVersion, Capabilities: CapInflightOthers, Epoch: uint64(len(c.routers)+1) << 8})
}

// addRouterAs starts a router announcing meta and has it meet every member
// already running.
func (c *cluster) addRouterAs(meta Meta) *simRouter {
	r := &simRouter{member: "router/" + meta.Name, tb: fleet.NewTable(fleet.TableConfig{}), meta: meta}
	r.r = NewReceiver(ReceiverConfig{Self: r.member, Epoch: r.meta.Epoch}, r.tb)
	c.routers[r.member] = r
	for _, o := range c.routers {
		if o != r {
			c.take(r.member, r.r.Member(o.member, o.meta, c.now))
			c.take(o.member, o.r.Member(r.member, r.meta, c.now))
		}
	}
	for _, s := range c.sidecars {
		c.meet(s, r)
	}
	return r
}

// addSidecar starts sidecar name with a filter of boot epoch epoch and has
// it meet every router.
func (c *cluster) addSidecar(name string, epoch uint64) *simSidecar {
	return c.addSidecarAs(Meta{Role: RoleSidecar, Name: name, Models: []string{"m"}, Protocol: fleet.ProtocolVLLM, BlockSize: 16,
		SchemeVersion: blockkey.SchemeVersion, Capabilities: CapKVEvents | CapInflight | CapInflightOthers, Epoch: epoch})
}

// addSidecarAs starts a sidecar announcing meta (its filter's boot epoch
// meta.Epoch) and has it meet every router.
func (c *cluster) addSidecarAs(meta Meta) *simSidecar {
	name, epoch := meta.Name, meta.Epoch
	s := &simSidecar{member: "sidecar/" + name, engine: Load{Healthy: true, Waiting: 2, Running: 3, KVUsage: 0.25},
		g: bloom.NewGenerations(bloom.GenerationConfig{Capacity: 4096, MaxDeltaKeys: 8}, epoch, c.now), meta: meta}
	s.s = NewSender(SenderConfig{Self: s.member, Name: name, Epoch: epoch})
	c.sidecars[s.member] = s
	for _, r := range c.routers {
		c.meet(s, r)
	}
	return s
}

// meet tells sidecar s and router r of each other, as memberlist would.
func (c *cluster) meet(s *simSidecar, r *simRouter) {
	c.take(r.member, r.r.Member(s.member, s.meta, c.now))
	c.take(s.member, s.s.Member(r.member, r.meta, true))
}

// take queues what a member's state machine asked for: its messages, and
// for a sender the snapshots it wants sent (as the edge's snapshot sender
// does, of the filter as it is when the snapshot is taken).
func (c *cluster) take(from string, out Output) {
	c.resends += out.Resends
	if _, ok := c.routers[from]; ok {
		c.resyncs += out.Resyncs
	}
	for _, s := range out.Sends {
		c.queue = append(c.queue, packet{from: from, to: s.To, wire: s.Msg.Append(nil), kind: s.Msg.Kind, reliable: s.Reliable})
	}
	if s := c.sidecars[from]; s != nil {
		if out.Cleared {
			// The sidecar rebuilds from its exact set at once.
			s.g.Rebuild(c.now, slices.Values(s.keys))
		}
		for _, to := range out.Snapshots {
			m := SnapshotMessage(from, s.g.Snapshot())
			c.queue = append(c.queue, packet{from: from, to: to, wire: m.Append(nil), kind: KindSnapshot, reliable: true})
		}
	}
	if r := c.routers[from]; r != nil && out.Cleared {
		r.clears++
	}
}

// deliver hands every packet in flight, and those its answers provoke, to
// its member (bounded: a loop of answers fails the test).
func (c *cluster) deliver() {
	c.t.Helper()
	for range 10_000 {
		if len(c.queue) == 0 {
			return
		}
		p := c.queue[0]
		c.queue = c.queue[1:]
		copies := 1
		if c.fault != nil {
			copies = c.fault(p)
		}
		for range copies {
			c.hand(p)
		}
	}
	c.t.Fatal("messages still in flight after 10,000 deliveries")
}

// hand delivers one packet through the decoder, as the transport does.
func (c *cluster) hand(p packet) {
	c.t.Helper()
	m, err := Decode(p.wire)
	if err != nil {
		c.t.Fatalf("%s from %s: %v", p.kind, p.from, err)
	}
	if m.From != p.from {
		c.t.Fatalf("%s from %s names %s", p.kind, p.from, m.From)
	}
	if r := c.routers[p.to]; r != nil {
		c.delivered[p.kind]++
		c.take(r.member, r.r.Handle(&m, c.now))
	} else if s := c.sidecars[p.to]; s != nil {
		c.delivered[p.kind]++
		c.take(s.member, s.s.Handle(&m, c.now))
	}
}

// add stores keys at sidecar s's engine.
func (s *simSidecar) add(keys ...uint64) {
	for _, k := range keys {
		s.g.Add(k)
	}
	s.keys = append(s.keys, keys...)
}

// rebuild makes s publish a new generation holding only keep.
func (c *cluster) rebuild(s *simSidecar, keep ...uint64) {
	for _, k := range s.keys {
		if !slices.Contains(keep, k) {
			s.g.Remove(k)
		}
	}
	s.keys = slices.Clone(keep)
	s.g.Rebuild(c.now, slices.Values(keep))
}

// flush runs every sidecar's delta flush (25 ms) and, when load, its load
// record.
func (c *cluster) flush(load bool) {
	for _, name := range sortedKeys(c.sidecars) {
		s := c.sidecars[name]
		c.take(s.member, s.s.Flush(s.g))
		if load {
			c.take(s.member, s.s.Load(s.engine, s.g, false, c.now))
		}
	}
}

// tick runs every router's tick.
func (c *cluster) tick() {
	for _, name := range sortedKeys(c.routers) {
		r := c.routers[name]
		c.take(r.member, r.r.Tick(c.now))
	}
}

// rounds runs n rounds of 25 ms: flushes, a load record every fourth, a
// router tick every second, deliveries.
func (c *cluster) rounds(n int) {
	c.t.Helper()
	for i := range n {
		c.now = c.now.Add(25 * time.Millisecond)
		c.flush(i%4 == 3)
		if i%2 == 1 {
			c.tick()
		}
		c.deliver()
	}
}

// settle runs 5 s of rounds on a faultless network.
func (c *cluster) settle() {
	c.t.Helper()
	c.fault = nil
	c.rounds(200)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// holds fails unless router r routes by sidecar s's current filter (its
// generation, key count and every resident key) and load.
func (c *cluster) holds(r *simRouter, s *simSidecar) {
	c.t.Helper()
	rep, ok := replica(r.tb, s.meta.Name)
	if !ok {
		c.t.Fatalf("%s: no replica %s", r.member, s.meta.Name)
	}
	st := s.g.Stats()
	if !rep.Online || rep.Orphan || !rep.KVEvents || rep.Filter == nil {
		c.t.Fatalf("%s: replica %s not routed by filter: %+v", r.member, s.meta.Name, rep)
	}
	if rep.FilterGeneration != st.Generation || rep.FilterKeys != st.Keys {
		c.t.Fatalf("%s: %s's filter generation %d with %d keys, sidecar at %d with %d",
			r.member, s.meta.Name, rep.FilterGeneration, rep.FilterKeys, st.Generation, st.Keys)
	}
	for _, k := range s.keys {
		if !rep.Filter.Test(k) {
			c.t.Fatalf("%s: %s's filter lacks resident key %d", r.member, s.meta.Name, k)
		}
	}
	want := fleet.Load{Waiting: s.engine.Waiting, Running: s.engine.Running, KVUsage: float64(s.engine.KVUsage)}
	if rep.Load != want {
		c.t.Fatalf("%s: %s's load %+v, want %+v", r.member, s.meta.Name, rep.Load, want)
	}
}

// lacks fails if router r's filter for s holds key.
func (c *cluster) lacks(r *simRouter, s *simSidecar, key uint64) {
	c.t.Helper()
	if hasKey(r.tb, s.meta.Name, key) {
		c.t.Fatalf("%s: %s's filter still holds key %d", r.member, s.meta.Name, key)
	}
}

// loseFirst makes the network lose the next datagram of kind, and counts
// the losses in *lost.
func (c *cluster) loseFirst(kind Kind) (lost *int) {
	lost = new(int)
	c.fault = func(p packet) verdict {
		if p.kind == kind && *lost == 0 {
			*lost++
			return 0
		}
		return 1
	}
	return lost
}

// seq returns n keys from base on.
func seq(base uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = base + uint64(i)
	}
	return out
}

// TestStreamConvergesUnderFaults: keys stored, a rebuild, more keys, over a
// network that loses, reorders or duplicates messages; once it is clean
// again every router holds every sidecar's current filter and load.
func TestStreamConvergesUnderFaults(t *testing.T) {
	for _, tc := range []struct {
		name    string
		repairs bool // resyncs expected
		fault   func(rng *rand.Rand, c *cluster) func(packet) verdict
	}{
		{"lose a fifth of the datagrams", true, func(rng *rand.Rand, _ *cluster) func(packet) verdict {
			return func(p packet) verdict {
				if !p.reliable && rng.IntN(5) == 0 {
					return 0
				}
				return 1
			}
		}},
		{"duplicate everything", false, func(*rand.Rand, *cluster) func(packet) verdict {
			return func(packet) verdict { return 2 }
		}},
		{"reorder", true, func(rng *rand.Rand, c *cluster) func(packet) verdict {
			return func(p packet) verdict {
				// Hold a third of the packets back behind the rest.
				if rng.IntN(3) == 0 && len(c.queue) > 0 {
					c.queue = append(c.queue, p)
					return 0
				}
				return 1
			}
		}},
		{"lose and duplicate", true, func(rng *rand.Rand, _ *cluster) func(packet) verdict {
			return func(p packet) verdict {
				if p.reliable {
					return 1
				}
				return rng.IntN(3) // 0, 1 or 2 copies
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t)
			r1, r2 := c.addRouter("r1"), c.addRouter("r2")
			a, b := c.addSidecar("a", 0xa1), c.addSidecar("b", 0xb1)
			c.settle()
			c.fault = tc.fault(rand.New(rand.NewPCG(1, 2)), c)
			for i := range 40 {
				a.add(seq(uint64(1000+10*i), 10)...)
				b.add(seq(uint64(5000+10*i), 10)...)
				if i == 20 {
					c.rebuild(a, a.keys[100:]...)
				}
				c.rounds(2)
			}
			c.settle()
			for _, r := range []*simRouter{r1, r2} {
				c.holds(r, a)
				c.holds(r, b)
			}
			if st := a.g.Stats(); st.Generation != 2 {
				t.Fatalf("sidecar a at generation %d, want 2", st.Generation)
			}
			// A duplicate never looks like a loss; the other faults are
			// noticed and repaired.
			if resynced := c.resyncs > 0; resynced != tc.repairs {
				t.Fatalf("%d resyncs (%d deltas resent), want repairs %v", c.resyncs, c.resends, tc.repairs)
			}
		})
	}
}

// TestLostDeltaIsResentNotSnapshotted: a router that lost one delta asks
// for just what it misses and gets it from the deltas the sidecar keeps.
func TestLostDeltaIsResentNotSnapshotted(t *testing.T) {
	c := newCluster(t)
	r := c.addRouter("r1")
	a := c.addSidecar("a", 0xa1)
	a.add(1)
	c.settle()
	snapshots := c.delivered[KindSnapshot]
	lost := c.loseFirst(KindDelta)
	a.add(2)
	c.rounds(1)
	c.lacks(r, a, 2)
	a.add(3)
	c.rounds(1) // the next delta shows the hole: resync, resend
	c.holds(r, a)
	// Resent: the lost delta and the one after it, which the resync's
	// answer covers too.
	if *lost != 1 || c.resends != 2 || c.delivered[KindSnapshot] != snapshots {
		t.Fatalf("lost %d, resent %d, snapshots %d after the loss", *lost, c.resends, c.delivered[KindSnapshot]-snapshots)
	}
}

// TestLostTrailingDeltaIsNoticedByLoadRecords: the last delta of a burst is
// lost and no delta follows; the load records announce it.
func TestLostTrailingDeltaIsNoticedByLoadRecords(t *testing.T) {
	c := newCluster(t)
	r := c.addRouter("r1")
	a := c.addSidecar("a", 0xa1)
	c.settle()
	lost := c.loseFirst(KindDelta)
	a.add(7)
	c.rounds(1)
	c.lacks(r, a, 7)
	c.rounds(12) // three load records
	c.holds(r, a)
	if *lost != 1 || c.resyncs != 1 {
		t.Fatalf("%d deltas lost, %d resyncs; want 1, 1", *lost, c.resyncs)
	}
}

// TestLeavingRecordsSurviveALostCopy: the sidecar's last load record goes
// leavingCopies times; one lost, the replica still leaves routing when the
// sidecar is gone, where a sidecar that vanished leaves an orphan.
func TestLeavingRecordsSurviveALostCopy(t *testing.T) {
	for _, leaves := range []bool{true, false} {
		t.Run(fmt.Sprintf("leaving=%v", leaves), func(t *testing.T) {
			c := newCluster(t)
			r := c.addRouter("r1")
			a := c.addSidecar("a", 0xa1)
			a.add(1, 2)
			c.settle()
			c.holds(r, a)
			if leaves {
				lost := c.loseFirst(KindLoad)
				c.take(a.member, a.s.Load(a.engine, a.g, true, c.now))
				c.deliver()
				if *lost != 1 {
					t.Fatal("no copy lost")
				}
			}
			delete(c.sidecars, a.member)
			out := r.r.Gone(a.member, c.now)
			rep, listed := replica(r.tb, "a")
			switch {
			case leaves && listed:
				t.Fatalf("leaving sidecar's replica still listed: %+v", rep)
			case !leaves && (!listed || !rep.Orphan || !rep.Online || rep.Filter != nil || !slices.Equal(out.Orphaned, []string{"a"})):
				t.Fatalf("vanished sidecar's replica: listed %v %+v, orphaned %v", listed, rep, out.Orphaned)
			}
		})
	}
}

// TestSidecarRestartIsANewEpoch: the sidecar restarts under its name with a
// new epoch and an empty engine; nothing of the old epoch survives, not even
// its messages still in flight, and the new filter is routed by.
func TestSidecarRestartIsANewEpoch(t *testing.T) {
	c := newCluster(t)
	r := c.addRouter("r1")
	old := c.addSidecar("a", 0xa1)
	old.add(seq(100, 20)...)
	c.settle()
	c.holds(r, old)
	// The old process's last messages are still on their way.
	old.add(200)
	c.take(old.member, old.s.Flush(old.g))
	late := c.queue
	c.queue = nil

	a := c.addSidecar("a", 0xa2) // the same member name: replaces old
	a.add(300, 301)
	c.rounds(8)
	c.queue = append(c.queue, late...)
	c.take(old.member, lateSnapshot(old, r))
	c.settle()
	c.holds(r, a)
	for _, k := range []uint64{100, 119, 200} {
		c.lacks(r, a, k)
	}
}

// lateSnapshot is the old process's snapshot to r, as its snapshot
// sender would still deliver it.
func lateSnapshot(s *simSidecar, r *simRouter) Output {
	return Output{Sends: []Send{{To: r.member, Msg: SnapshotMessage(s.member, s.g.Snapshot()), Reliable: true}}}
}

// TestRouterRestartGetsEverySnapshot: a router restarts with an empty
// table; the sidecars, seeing it join again, send it their snapshots.
func TestRouterRestartGetsEverySnapshot(t *testing.T) {
	c := newCluster(t)
	c.addRouter("r1")
	a, b := c.addSidecar("a", 0xa1), c.addSidecar("b", 0xb1)
	a.add(seq(10, 30)...)
	b.add(seq(90, 5)...)
	c.settle()
	delete(c.routers, "router/r1")
	for _, s := range []*simSidecar{a, b} {
		s.s.Gone("router/r1")
	}
	a.add(77) // while the router is down
	c.rounds(4)
	r := c.addRouter("r1")
	c.settle()
	c.holds(r, a)
	c.holds(r, b)
}

// TestLateJoinerGetsTheCurrentGeneration: a router joins after the sidecar
// has rebuilt twice and streamed deltas; it is sent the current generation
// and follows the deltas after it.
func TestLateJoinerGetsTheCurrentGeneration(t *testing.T) {
	c := newCluster(t)
	r1 := c.addRouter("r1")
	a := c.addSidecar("a", 0xa1)
	a.add(seq(1, 50)...)
	c.rounds(4)
	c.rebuild(a, seq(1, 10)...)
	c.rounds(4)
	c.rebuild(a, seq(1, 5)...)
	a.add(60, 61)
	c.rounds(4)
	r2 := c.addRouter("r2")
	a.add(62) // a delta on the heels of the join, before the snapshot lands
	c.settle()
	c.holds(r1, a)
	c.holds(r2, a)
	c.lacks(r2, a, 40)
}

// TestClearRacingARebuild: router r1 clears a's routes. The sidecar's
// rebuild for it reaches r2 before r1's clear does, so r2 awaits a
// generation that never comes and, after clearWait, shows the filter the
// load records prove current. r1 shows the rebuilt generation once it
// lands; neither routes by the pre-clear filter meanwhile.
func TestClearRacingARebuild(t *testing.T) {
	c := newCluster(t)
	r1, r2 := c.addRouter("r1"), c.addRouter("r2")
	a := c.addSidecar("a", 0xa1)
	a.add(1, 2, 3)
	c.settle()
	gen := a.g.Stats().Generation
	c.take(r1.member, r1.r.ClearRoutes([]string{"a"}, 42, c.now))
	c.lacks(r1, a, 1)
	// The clear reaches the sidecar, which rebuilds, and the rebuilt
	// generation reaches r2 before the clear to r2 does.
	toR2 := slices.DeleteFunc(slices.Clone(c.queue), func(p packet) bool { return p.to != r2.member })
	c.queue = slices.DeleteFunc(c.queue, func(p packet) bool { return p.to == r2.member })
	c.deliver()
	c.rounds(1)
	if a.g.Stats().Generation != gen+1 {
		t.Fatalf("sidecar at generation %d, want %d", a.g.Stats().Generation, gen+1)
	}
	c.holds(r1, a)
	c.holds(r2, a)
	c.queue = append(c.queue, toR2...)
	c.deliver()
	if r2.clears != 1 {
		t.Fatalf("r2 heard %d clears", r2.clears)
	}
	c.lacks(r2, a, 1) // awaiting generation gen+2
	c.rounds(int((clearWait - 250*time.Millisecond) / (25 * time.Millisecond)))
	c.lacks(r2, a, 1)
	c.rounds(40)
	c.holds(r2, a)
}

// TestClearReachingNoSidecar: the clear never reaches the sidecar, which
// goes on adding to the generation held; after clearWait the routers fetch
// what they missed.
func TestClearReachingNoSidecar(t *testing.T) {
	c := newCluster(t)
	r1, r2 := c.addRouter("r1"), c.addRouter("r2")
	a := c.addSidecar("a", 0xa1)
	a.add(1)
	c.settle()
	c.fault = func(p packet) verdict {
		if p.kind == KindClearRoutes && p.to == a.member {
			return 0
		}
		return 1
	}
	c.take(r1.member, r1.r.ClearRoutes(nil, 43, c.now))
	c.deliver()
	a.add(2, 3)
	c.rounds(8)
	c.lacks(r1, a, 1)
	c.lacks(r2, a, 1)
	c.settle()
	c.holds(r1, a)
	c.holds(r2, a)
}

// TestInflightReachesTheOtherRouters: each router's in-flight work at a
// replica comes back to every other router through the sidecar's load
// records, never to itself.
func TestInflightReachesTheOtherRouters(t *testing.T) {
	c := newCluster(t)
	r1, r2 := c.addRouter("r1"), c.addRouter("r2")
	a := c.addSidecar("a", 0xa1)
	r1.r.SetInflight("a", 2, 100)
	r2.r.SetInflight("a", 3, 50)
	c.rounds(8)
	for _, tc := range []struct {
		r    *simRouter
		want [2]int
	}{{r1, [2]int{3, 50}}, {r2, [2]int{2, 100}}} {
		rep, _ := replica(tc.r.tb, "a")
		if got := [2]int{rep.Load.OthersInflightRequests, rep.Load.OthersInflightPrefillTokens}; got != tc.want {
			t.Errorf("%s sees others' in-flight %v, want %v", tc.r.member, got, tc.want)
		}
	}
	if req, tok := a.s.Inflight(c.now); req != 5 || tok != 150 {
		t.Errorf("sidecar sums %d requests, %d tokens; want 5, 150", req, tok)
	}
	r1.r.SetInflight("a", 0, 0)
	c.rounds(8)
	if req, _ := a.s.Inflight(c.now); req != 3 {
		t.Errorf("after r1's work finished the sidecar sums %d requests, want 3", req)
	}
}
