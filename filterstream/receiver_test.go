package filterstream

import (
	"testing"
	"time"
	"unsafe"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
)

// feedRouter drives a Receiver with hand-made messages from one sidecar
// member, "sidecar/a", and counts the resyncs it asks for.
type feedRouter struct {
	t       *testing.T
	r       *Receiver
	tb      *fleet.Table
	now     time.Time
	sent    []Send
	resyncs uint64
}

var sidecarA = Meta{Role: RoleSidecar, Name: "a", Models: []string{"m"}, Protocol: "vllm", BlockSize: 16,
	SchemeVersion: blockkey.SchemeVersion, Capabilities: CapKVEvents | CapInflight, Epoch: 7}

func newFeedRouter(t *testing.T) *feedRouter {
	f := &feedRouter{t: t, now: time.Unix(1_900_000_000, 0), tb: fleet.NewTable(fleet.TableConfig{})}
	f.r = NewReceiver(ReceiverConfig{Self: "router/r1", Epoch: 99}, f.tb)
	f.take(f.r.Member("sidecar/a", sidecarA, f.now))
	return f
}

// take records what the receiver asked for.
func (f *feedRouter) take(out Output) {
	f.sent = append(f.sent, out.Sends...)
	f.resyncs += uint64(out.Resyncs)
}

func (f *feedRouter) member(meta Meta) { f.take(f.r.Member("sidecar/a", meta, f.now)) }

func (f *feedRouter) deliver(m Message) {
	f.t.Helper()
	m.From = "sidecar/a"
	// Through the codec, as on the wire.
	dm, err := Decode(m.Append(nil))
	if err != nil {
		f.t.Fatal(err)
	}
	f.take(f.r.Handle(&dm, f.now))
}

func (f *feedRouter) snapshot(epoch, gen, seq uint64, keys ...uint64) {
	filter := bloom.NewFilter(1024, 0.001)
	for _, k := range keys {
		filter.Add(k)
	}
	s := bloom.Snapshot{Epoch: epoch, Generation: gen, Seq: seq, M: filter.M(), K: filter.K(), Keys: len(keys), Words: filter.AppendWords(nil)}
	f.deliver(SnapshotMessage("sidecar/a", s))
}

func (f *feedRouter) delta(epoch, gen, seq uint64, keys ...uint64) {
	d := bloom.Delta{Epoch: epoch, Generation: gen, Seq: seq, Keys: keys}
	f.deliver(Message{Kind: KindDelta, Epoch: epoch, Payload: d.AppendBinary(nil)})
}

func (f *feedRouter) load(epoch, seq, gen, fseq uint64, healthy bool) {
	f.deliver(Message{Kind: KindLoad, Epoch: epoch, Seq: seq, Load: Load{Healthy: healthy, Waiting: 1, FilterGen: gen, FilterSeq: fseq}})
}

func (f *feedRouter) advance(d time.Duration) { f.now = f.now.Add(d) }

func (f *feedRouter) has(key uint64) bool { return hasKey(f.tb, "a", key) }

// clearFrom delivers router from's route clear for sidecar a.
func (f *feedRouter) clearFrom(from string) {
	f.take(f.r.Handle(&Message{Kind: KindClearRoutes, From: from, Names: []string{"a"}}, f.now))
}

// loadsFor sends epoch 7's load records every 100 ms for d, numbered on
// from *seq, announcing filter generation gen at sequence fseq.
func (f *feedRouter) loadsFor(d time.Duration, seq *uint64, gen, fseq uint64) {
	for end := f.now.Add(d); f.now.Before(end); *seq++ {
		f.advance(100 * time.Millisecond)
		f.load(7, *seq, gen, fseq, true)
	}
}

// replica is the table's entry for name.
func replica(tb *fleet.Table, name string) (rep fleet.Replica, ok bool) {
	snap := tb.Snapshot()
	if i := snap.Find(name); i >= 0 {
		rep, ok = snap.Replicas[i], true
	}
	return rep, ok
}

// hasKey reports whether routing matches key at replica name.
func hasKey(tb *fleet.Table, name string, key uint64) bool {
	snap := tb.Snapshot()
	matched := make([]int, len(snap.Replicas))
	snap.MatchPrefix([]uint64{key}, matched)
	i := snap.Find(name)
	return i >= 0 && matched[i] == 1
}

func TestRouterAppliesDeltasAndResyncsOnGap(t *testing.T) {
	f := newFeedRouter(t)
	f.snapshot(7, 1, 0, 100)
	f.delta(7, 1, 1, 101)
	f.delta(7, 1, 2, 102)
	if !f.has(100) || !f.has(101) || !f.has(102) {
		t.Fatal("snapshot + deltas not applied")
	}
	if rep, _ := replica(f.tb, "a"); rep.FilterGeneration != 1 || rep.FilterKeys != 3 {
		t.Fatalf("%+v", rep)
	}
	f.delta(7, 1, 4, 104) // 3 was lost
	if f.has(104) || f.resyncs != 1 {
		t.Fatalf("gap: has %v, resyncs %d", f.has(104), f.resyncs)
	}
	f.delta(7, 1, 5, 105) // still a gap, but rate-limited
	if f.resyncs != 1 {
		t.Fatalf("resync not rate limited: %d", f.resyncs)
	}
	f.advance(time.Second)
	f.snapshot(7, 1, 5, 100, 101, 102, 103, 104, 105) // the answer
	if !f.has(103) || !f.has(105) {
		t.Fatal("resync snapshot not applied")
	}
	f.snapshot(7, 1, 2, 100) // a late, older snapshot must not roll back
	if !f.has(105) {
		t.Fatal("older snapshot replaced newer state")
	}
}

func TestRouterBuffersDeltasAheadOfTheirSnapshot(t *testing.T) {
	f := newFeedRouter(t)
	f.snapshot(7, 1, 0, 1)
	// Generation 2's first deltas overtake its snapshot (UDP vs TCP).
	f.delta(7, 2, 1, 21)
	f.delta(7, 2, 2, 22)
	if f.has(21) || f.resyncs != 0 {
		t.Fatal("delta of an unknown generation applied or resynced")
	}
	f.snapshot(7, 2, 0, 20)
	if !f.has(20) || !f.has(21) || !f.has(22) {
		t.Fatal("buffered deltas not replayed after their snapshot")
	}
	f.delta(7, 1, 9, 19) // old generation: ignored, no resync
	if f.has(19) || f.resyncs != 0 {
		t.Fatal("old-generation delta applied or resynced")
	}
}

func TestRouterLoadRecordsDriveResyncAndEpochs(t *testing.T) {
	f := newFeedRouter(t)
	// The sidecar says generation 3 seq 4 exists; the router has nothing.
	for seq := uint64(1); seq <= 2; seq++ {
		f.load(7, seq, 3, 4, true)
	}
	if f.resyncs != 0 {
		t.Fatal("resync before three load records")
	}
	f.load(7, 3, 3, 4, true)
	if f.resyncs != 1 {
		t.Fatalf("resyncs %d, want 1", f.resyncs)
	}
	f.snapshot(7, 3, 4, 30)
	f.load(7, 2, 3, 4, true) // reordered old record: ignored
	if rep, _ := replica(f.tb, "a"); rep.Load.Waiting != 1 || !f.has(30) {
		t.Fatalf("%+v", rep)
	}
	// Engine restart at the sidecar: a new epoch. Nothing of the old holds.
	f.load(8, 1, 1, 0, true)
	if f.has(30) {
		t.Fatal("filter of the old epoch survived a new epoch")
	}
	f.snapshot(8, 1, 0, 31)
	if !f.has(31) {
		t.Fatal("new epoch's snapshot not applied")
	}
	// Unhealthy: offline at once, filter gone.
	f.load(8, 2, 1, 0, false)
	if rep, _ := replica(f.tb, "a"); rep.Online || f.has(31) {
		t.Fatalf("unhealthy replica still usable: %+v", rep)
	}
}

func TestRouterShowsKeptFilterAfterSilenceIfCurrent(t *testing.T) {
	f := newFeedRouter(t)
	f.snapshot(7, 1, 0, 1)
	f.load(7, 1, 1, 0, true)
	f.advance(time.Second) // silent past DropAfter
	out := f.r.Tick(f.now)
	if len(out.Silent) != 1 || f.has(1) {
		t.Fatalf("silent %v, has %v", out.Silent, f.has(1))
	}
	f.load(7, 2, 1, 0, true) // back, nothing missed
	if rep, _ := replica(f.tb, "a"); !rep.Online || !f.has(1) || f.resyncs != 0 {
		t.Fatalf("not restored without a snapshot: %+v resyncs %d", rep, f.resyncs)
	}
}

func TestRouterIgnoresFiltersOfAnotherKeyScheme(t *testing.T) {
	f := newFeedRouter(t)
	f.member(Meta{Role: RoleSidecar, Name: "a", SchemeVersion: blockkey.SchemeVersion + 1, Capabilities: CapKVEvents, Epoch: 7})
	f.snapshot(7, 1, 0, 5)
	if rep, _ := replica(f.tb, "a"); rep.KVEvents || f.has(5) {
		t.Fatalf("foreign key scheme used for matching: %+v", rep)
	}
}

func TestRouterResyncsWhenBlockSizeIsLearned(t *testing.T) {
	f := newFeedRouter(t)
	f.snapshot(7, 1, 0, 1)
	f.member(Meta{Role: RoleSidecar, Name: "a", BlockSize: 32, SchemeVersion: blockkey.SchemeVersion, Capabilities: CapKVEvents, Epoch: 7})
	if f.has(1) || f.resyncs != 1 {
		t.Fatalf("block size change: has %v resyncs %d", f.has(1), f.resyncs)
	}
	f.snapshot(7, 1, 0, 1)
	if rep, _ := replica(f.tb, "a"); !f.has(1) || rep.BlockSize != 32 {
		t.Fatalf("%+v", rep)
	}
}

func TestRouterIgnoresLateFilterOfAnOldEpoch(t *testing.T) {
	f := newFeedRouter(t)
	f.load(7, 1, 1, 0, true)
	f.snapshot(7, 1, 0, 70)
	f.load(8, 2, 1, 0, true) // engine restarted: epoch 8
	f.snapshot(8, 1, 0, 80)
	f.snapshot(7, 1, 3, 70, 71) // epoch 7's snapshot arrives late
	f.delta(7, 1, 4, 72)
	if f.has(70) || f.has(72) || !f.has(80) {
		t.Fatalf("old epoch won: has70 %v has72 %v has80 %v", f.has(70), f.has(72), f.has(80))
	}
}

// TestRouterIgnoresLateLoadOfAnEpochLeft: one sidecar process keeps its
// load sequence across an engine restart (a new epoch); a reordered load
// record of the old epoch must not switch back and wipe the new filter.
func TestRouterIgnoresLateLoadOfAnEpochLeft(t *testing.T) {
	f := newFeedRouter(t)
	f.load(7, 1, 1, 0, true)
	f.snapshot(7, 1, 0, 70)
	f.load(8, 3, 1, 0, true) // engine restarted: epoch 8, load seq continues
	f.snapshot(8, 1, 0, 80)
	if !f.has(80) {
		t.Fatal("new epoch's snapshot not applied")
	}
	f.load(7, 2, 1, 0, true) // older record of epoch 7, reordered
	if !f.has(80) || f.has(70) {
		t.Fatalf("late load record of the old epoch won: has70 %v has80 %v", f.has(70), f.has(80))
	}
	f.delta(8, 1, 1, 81)
	f.load(8, 4, 1, 1, true)
	if !f.has(81) || f.resyncs != 0 {
		t.Fatalf("new epoch's stream disturbed: has81 %v resyncs %d", f.has(81), f.resyncs)
	}
}

// TestRouterStopsAwaitingAClearedGenerationThatNeverComes: the generation a
// sidecar rebuilt for another router's route clear (2) reached this router
// before that clear did, so the clear makes it await generation 3, which a
// sidecar without evictions never builds. The wait ends after clearWait:
// the filter held, proven current by the load records, is shown again.
func TestRouterStopsAwaitingAClearedGenerationThatNeverComes(t *testing.T) {
	f := newFeedRouter(t)
	f.load(7, 1, 1, 0, true)
	f.snapshot(7, 1, 0, 1)
	f.snapshot(7, 2, 0, 1, 2) // rebuilt because router A cleared
	f.clearFrom("router/A")
	if f.has(1) {
		t.Fatal("clear did not drop the filter")
	}
	seq := uint64(2)
	f.loadsFor(clearWait-200*time.Millisecond, &seq, 2, 0)
	if f.has(2) {
		t.Fatal("stopped awaiting a fresh generation early")
	}
	f.loadsFor(time.Second, &seq, 2, 0)
	if !f.has(2) || f.resyncs != 0 {
		t.Fatalf("current filter not shown again after the wait: has %v resyncs %d", f.has(2), f.resyncs)
	}
}

// TestRouterResyncsAfterAClearWhoseRebuildNeverComes: the clear did not
// reach the sidecar (or it could not rebuild), which went on adding to the
// generation held. After the wait the router fetches what it missed.
func TestRouterResyncsAfterAClearWhoseRebuildNeverComes(t *testing.T) {
	f := newFeedRouter(t)
	f.load(7, 1, 1, 0, true)
	f.snapshot(7, 1, 0, 1)
	f.clearFrom("router/A")
	f.delta(7, 1, 1, 2) // ignored while awaiting generation 2
	seq := uint64(2)
	f.loadsFor(clearWait+time.Second, &seq, 1, 1)
	if f.has(1) || f.resyncs == 0 {
		t.Fatalf("after the wait: has %v resyncs %d (want hidden, resynced)", f.has(1), f.resyncs)
	}
	f.delta(7, 1, 1, 2) // the resent delta
	if !f.has(1) || !f.has(2) {
		t.Fatal("filter not shown again once the missing delta came")
	}
}

func TestRouterKeepsDeltasThatOvertakeTheResyncSnapshot(t *testing.T) {
	f := newFeedRouter(t)
	f.snapshot(7, 1, 0, 1)
	f.delta(7, 1, 1, 2)
	f.delta(7, 1, 3, 4) // 2 lost: resync requested, 3 kept
	f.delta(7, 1, 4, 5)
	if f.resyncs != 1 || f.has(4) {
		t.Fatalf("resyncs %d has4 %v", f.resyncs, f.has(4))
	}
	f.snapshot(7, 1, 3, 1, 2, 3, 4) // the answer, taken at seq 3
	if !f.has(3) || !f.has(5) {
		t.Fatal("delta 4, which overtook the snapshot, was not replayed")
	}
	f.delta(7, 1, 5, 6)
	if !f.has(6) || f.resyncs != 1 {
		t.Fatalf("stream did not continue: has6 %v resyncs %d", f.has(6), f.resyncs)
	}
}

func TestRouterAsksForMissingDeltasFirstThenASnapshot(t *testing.T) {
	f := newFeedRouter(t)
	f.snapshot(7, 1, 0, 1)
	f.delta(7, 1, 1, 2)
	f.delta(7, 1, 3, 4) // 2 lost
	f.delta(7, 1, 4, 5)
	if f.resyncs != 1 {
		t.Fatalf("resyncs %d", f.resyncs)
	}
	f.delta(7, 1, 2, 3) // the resent delta fills the hole; 3 and 4 follow from the buffer
	if !f.has(3) || !f.has(4) || !f.has(5) {
		t.Fatal("buffered deltas not applied after the hole was filled")
	}
	p := f.r.sidecars["sidecar/a"]
	pending, streak := len(p.pending), p.resyncStreak
	if pending != 0 || streak != 0 {
		t.Fatalf("pending %d streak %d after recovery", pending, streak)
	}
}

func TestResyncMessageNamesWhatTheRouterHolds(t *testing.T) {
	m := Message{Kind: KindResync, From: "router/r1", Epoch: 7, Gen: 3, Seq: 41}
	got, err := Decode(m.Append(nil))
	if err != nil || got.Gen != 3 || got.Seq != 41 || got.Epoch != 7 {
		t.Fatalf("%+v %v", got, err)
	}
}

// TestRouterReadsInflightByTheSidecarsCapability: an older sidecar sums
// every router's report, so the router takes its own last report out; one
// that announces CapInflightOthers (learned here from a metadata update)
// already left it out.
func TestRouterReadsInflightByTheSidecarsCapability(t *testing.T) {
	f := newFeedRouter(t)
	others := func() [2]int {
		rep, _ := replica(f.tb, "a")
		return [2]int{rep.Load.OthersInflightRequests, rep.Load.OthersInflightPrefillTokens}
	}
	// As after a tick reported 2 requests, 300 tokens (and a later tick
	// reports the same).
	f.r.SetInflight("a", 2, 300)
	f.r.Tick(f.now)
	f.take(f.r.Tick(f.now)) // reports at every other tick
	if last := f.sent[len(f.sent)-1].Msg; last.Kind != KindInflight || last.Requests != 2 || last.PrefillTokens != 300 {
		t.Fatalf("report %+v", last)
	}
	f.deliver(Message{Kind: KindLoad, Epoch: 7, Seq: 1, Load: Load{Healthy: true, InflightRequests: 5, InflightPrefillTokens: 500}})
	if got := others(); got != [2]int{3, 200} {
		t.Fatalf("older sidecar: others %v, want its sum less this router's report (3, 200)", got)
	}
	withOthers := sidecarA
	withOthers.Capabilities |= CapInflightOthers
	f.member(withOthers)
	f.deliver(Message{Kind: KindLoad, Epoch: 7, Seq: 2, Load: Load{Healthy: true, InflightRequests: 5, InflightPrefillTokens: 500}})
	if got := others(); got != [2]int{5, 500} {
		t.Fatalf("sidecar leaving this router out: others %v, want (5, 500) as sent", got)
	}
}

// TestTenantUsageGoesToRoutersThatReadIt: a router's report reaches only
// the routers announcing CapTenantUsage (an older one would count it as a
// bad message), and only a known router's report is taken.
func TestTenantUsageGoesToRoutersThatReadIt(t *testing.T) {
	now := time.Unix(1000, 0)
	r := NewReceiver(ReceiverConfig{Self: "r0", Epoch: 1}, fleet.NewTable(fleet.TableConfig{}))
	r.Member("r1", Meta{Role: RoleRouter, Name: "r1", Capabilities: CapInflightOthers | CapTenantUsage}, now)
	r.Member("r-old", Meta{Role: RoleRouter, Name: "r-old", Capabilities: CapInflightOthers}, now)
	usage := []TenantUsage{{Tenant: "t", Requests: 3, Tokens: 900}}
	out := r.ShareUsage(usage)
	if len(out.Sends) != 1 || out.Sends[0].To != "r1" || out.Sends[0].Msg.Kind != KindTenantUsage || out.Sends[0].Reliable {
		t.Fatalf("sends %+v", out.Sends)
	}
	b := out.Sends[0].Msg.Append(nil)
	m, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	m.From = "r1"
	if got := r.Handle(&m, now).Usage; got == nil || got.From != "r1" || len(got.Usage) != 1 || got.Usage[0] != usage[0] {
		t.Fatalf("report from r1: %+v", got)
	}
	m.From = "stranger"
	if got := r.Handle(&m, now).Usage; got != nil {
		t.Fatalf("a report from no known router was taken: %+v", got)
	}
}

// TestRouterTableCarriesTheDataParallelRank: a sidecar's rank reaches its
// replica in the table, and a metadata update without one clears it.
func TestRouterTableCarriesTheDataParallelRank(t *testing.T) {
	f := newFeedRouter(t)
	dp := sidecarA
	dp.EngineURL, dp.DataParallel, dp.DataParallelRank = "http://e:8000", true, 3
	for _, c := range []struct {
		meta Meta
		dp   bool
		rank int
	}{{dp, true, 3}, {sidecarA, false, 0}} {
		f.member(c.meta)
		r := f.tb.Snapshot().Replicas[0]
		if r.DataParallel != c.dp || r.DataParallelRank != c.rank || r.URL != c.meta.EngineURL {
			t.Fatalf("replica %+v: data-parallel %v rank %d at %q, want %v %d at %q", r.Name, r.DataParallel, r.DataParallelRank, r.URL, c.dp, c.rank, c.meta.EngineURL)
		}
	}
}

// TestRouterTableCarriesTheKVRole: a sidecar's KV role reaches its replica
// in the table, and a metadata update without one makes it both again.
func TestRouterTableCarriesTheKVRole(t *testing.T) {
	f := newFeedRouter(t)
	prefill := sidecarA
	prefill.KVRole = uint8(fleet.KVPrefill)
	for _, c := range []struct {
		meta Meta
		want fleet.KVRole
	}{{prefill, fleet.KVPrefill}, {sidecarA, fleet.KVBoth}} {
		f.member(c.meta)
		if r := f.tb.Snapshot().Replicas[0]; r.KVRole != c.want {
			t.Fatalf("replica %s: role %v, want %v", r.Name, r.KVRole, c.want)
		}
	}
}

func TestFootprintCountsFiltersAndBufferedDeltas(t *testing.T) {
	f := newFeedRouter(t)
	empty := f.r.Footprint()
	if empty.Sidecars != 1 || empty.FilterBytes != 0 || empty.PendingBytes != 0 || empty.StateBytes <= len("sidecar/a") {
		t.Fatalf("before any snapshot: %+v", empty)
	}
	f.snapshot(7, 1, 0, 1, 2, 3)
	words := len(bloom.NewFilter(1024, 0.001).Words())
	f.delta(7, 2, 1, 21, 22) // ahead of generation 2's snapshot: buffered
	fp := f.r.Footprint()
	if fp.FilterBytes != 8*words || fp.PendingBytes != int(unsafe.Sizeof(bloom.Delta{}))+16 || fp.StateBytes != empty.StateBytes {
		t.Fatalf("one %d-word filter and a 2-key delta buffered: %+v", words, fp)
	}
	f.snapshot(7, 2, 0, 20)
	if fp := f.r.Footprint(); fp.FilterBytes != 8*words || fp.PendingBytes != 0 {
		t.Fatalf("after the snapshot the delta was waiting for: %+v", fp)
	}
}
