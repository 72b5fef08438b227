package bloom

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

var t0 = time.Date(2026, 11, 30, 2, 0, 0, 0, time.UTC)

// exactSet is a test stand-in for the sidecar's resident set.
type exactSet map[uint64]bool

func (s exactSet) keys(yield func(uint64) bool) {
	for k := range s {
		if !yield(k) {
			return
		}
	}
}

func TestDeltasFollowSnapshotAndReproduceTheFilter(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 1000}, 77, t0)
	keys := randomKeys(5, 300)
	for _, k := range keys[:100] {
		g.Add(k)
	}
	if _, ok := g.TakeDelta(); !ok {
		t.Fatal("no delta after 100 adds")
	}
	snap := g.Snapshot() // as of seq 1
	if snap.Epoch != 77 || snap.Generation != 1 || snap.Seq != 1 || snap.Keys != 100 {
		t.Fatalf("snapshot header %d/%d/%d keys %d, want 77/1/1 keys 100", snap.Epoch, snap.Generation, snap.Seq, snap.Keys)
	}
	var m Mirror
	if err := m.ApplySnapshot(snap); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys[100:200] {
		g.Add(k)
	}
	d2, _ := g.TakeDelta()
	for _, k := range keys[200:] {
		g.Add(k)
	}
	d3, _ := g.TakeDelta()
	if d2.Seq != 2 || d3.Seq != 3 || len(d2.Keys) != 100 || !slices.Equal(d3.Keys, keys[200:]) {
		t.Fatalf("deltas seq %d (%d keys), %d (%d keys)", d2.Seq, len(d2.Keys), d3.Seq, len(d3.Keys))
	}
	if _, ok := g.TakeDelta(); ok {
		t.Fatal("delta without adds")
	}
	if !m.ApplyDelta(d2) || !m.ApplyDelta(d3) {
		t.Fatal("in-order deltas refused")
	}
	if !m.ApplyDelta(d2) {
		t.Fatal("a repeated delta must be ignored, not refused")
	}
	if !slices.Equal(m.Filter().Words(), g.Snapshot().Words) {
		t.Fatal("mirror's filter differs from the sidecar's")
	}
	if st := m.State(); st.Keys != 300 || st.Seq != 3 || g.Stats().Keys != 300 {
		t.Fatalf("mirror at seq %d with %d keys, sidecar %d keys; want 3, 300", st.Seq, st.Keys, g.Stats().Keys)
	}
}

func TestMirrorRefusesWhatDoesNotFollowOn(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 100}, 1, t0)
	var m Mirror
	g.Add(1)
	d1, _ := g.TakeDelta()
	if m.ApplyDelta(d1) {
		t.Fatal("delta before any snapshot accepted")
	}
	if err := m.ApplySnapshot(g.Snapshot()); err != nil {
		t.Fatal(err)
	}
	g.Add(2)
	g.TakeDelta() // lost
	g.Add(3)
	d3, _ := g.TakeDelta()
	if m.ApplyDelta(d3) {
		t.Fatal("delta after a gap accepted")
	}
	if m.Filter().Test(3) {
		t.Fatal("refused delta was applied")
	}
	other := d3
	other.Epoch = 2
	if m.ApplyDelta(other) {
		t.Fatal("delta of another epoch accepted")
	}
	// Resync: the sidecar's snapshot covers the lost delta.
	if err := m.ApplySnapshot(g.Snapshot()); err != nil {
		t.Fatal(err)
	}
	if !m.Filter().Test(2) || !m.Filter().Test(3) {
		t.Fatal("resync snapshot lost keys")
	}
	old := g.Snapshot()
	g.Rebuild(t0, exactSet{1: true, 2: true, 3: true}.keys)
	if err := m.ApplySnapshot(g.Snapshot()); err != nil || m.Generation() != 2 {
		t.Fatalf("generation 2 snapshot: %v, mirror at generation %d", err, m.Generation())
	}
	if err := m.ApplySnapshot(old); err == nil {
		t.Fatal("a generation-1 snapshot replaced generation 2")
	}
	if m.ApplyDelta(d3) {
		t.Fatal("delta of the previous generation accepted")
	}
	restarted := NewGenerations(GenerationConfig{Capacity: 100}, 9, t0)
	if err := m.ApplySnapshot(restarted.Snapshot()); err != nil || m.Generation() != 1 || m.Filter().Test(1) {
		t.Fatalf("new epoch's generation 1 snapshot: err %v, generation %d", err, m.Generation())
	}
	m.Reset()
	if m.Filter() != nil || m.Keys() != 0 {
		t.Fatal("reset mirror still has a filter")
	}
}

func TestRebuildTriggers(t *testing.T) {
	cfg := GenerationConfig{Capacity: 1000, RebuildRemovedFraction: 0.1, MaxAge: time.Minute}
	t.Run("removed fraction", func(t *testing.T) {
		g := NewGenerations(cfg, 1, t0)
		keys := randomKeys(1, 200)
		for _, k := range keys {
			g.Add(k)
		}
		for _, k := range keys[:20] {
			g.Remove(k)
		}
		if g.NeedsRebuild(t0) {
			t.Fatal("10 % removed: rebuild already")
		}
		g.Remove(keys[20])
		if !g.NeedsRebuild(t0) {
			t.Fatal("21 of 200 removed: no rebuild")
		}
	})
	t.Run("fill ratio", func(t *testing.T) {
		g := NewGenerations(cfg, 1, t0)
		n := 0
		for _, k := range randomKeys(2, 3000) {
			if g.NeedsRebuild(t0) {
				break
			}
			g.Add(k)
			n++
		}
		// The default limit is the fill at which the FPR doubles: somewhat
		// past capacity.
		if n < 1000 || n > 1600 {
			t.Fatalf("fill trigger after %d keys in a filter for 1000", n)
		}
	})
	t.Run("age only with removals", func(t *testing.T) {
		g := NewGenerations(cfg, 1, t0)
		g.Add(1)
		if g.NeedsRebuild(t0.Add(time.Hour)) {
			t.Fatal("old generation without removals rebuilt")
		}
		g.Add(2)
		g.Remove(2)
		g.Add(3)
		g.Add(4)
		for i := range 20 {
			g.Add(uint64(100 + i))
		}
		if g.NeedsRebuild(t0.Add(59 * time.Second)) {
			t.Fatal("young generation rebuilt")
		}
		if !g.NeedsRebuild(t0.Add(time.Minute)) {
			t.Fatal("generation at MaxAge with a removal not rebuilt")
		}
	})
	t.Run("clear", func(t *testing.T) {
		g := NewGenerations(cfg, 1, t0)
		g.Add(1)
		g.Clear()
		if !g.NeedsRebuild(t0) {
			t.Fatal("no rebuild after clear")
		}
		g.Rebuild(t0, exactSet{}.keys)
		if g.NeedsRebuild(t0) {
			t.Fatal("rebuild wanted right after rebuild")
		}
		if st := g.Stats(); st.Generation != 2 || st.Keys != 0 || st.FillRatio != 0 {
			t.Fatalf("after clear and rebuild: %+v", st)
		}
	})
}

func TestRebuildDropsRemovedKeysAndGrows(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 1000}, 1, t0)
	keys := randomKeys(8, 3000)
	set := exactSet{}
	for _, k := range keys {
		g.Add(k)
		set[k] = true
	}
	for _, k := range keys[:1500] {
		g.Remove(k)
		delete(set, k)
	}
	g.TakeDelta()
	g.Rebuild(t0.Add(time.Second), set.keys)
	snap := g.Snapshot()
	if snap.Generation != 2 || snap.Seq != 0 || snap.Keys != 1500 {
		t.Fatalf("rebuilt snapshot %d/%d keys %d, want 2/0 keys 1500", snap.Generation, snap.Seq, snap.Keys)
	}
	if _, ok := g.TakeDelta(); ok {
		t.Fatal("rebuild left pending delta keys")
	}
	f, _ := FromWords(snap.Words, snap.M, snap.K)
	if want := uint(NewFilter(1875, 0.01).M()); f.M() != want {
		t.Fatalf("1500 live keys > capacity 1000: m=%d, want %d (sized for 1875)", f.M(), want)
	}
	stale := 0
	for _, k := range keys[:1500] {
		if f.Test(k) {
			stale++
		}
	}
	for _, k := range keys[1500:] {
		if !f.Test(k) {
			t.Fatalf("live key %x missing after rebuild", k)
		}
	}
	if stale > 40 {
		t.Fatalf("%d of 1500 removed keys still test positive", stale)
	}
}

func TestMaxDeltaKeysSplitsDeltas(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 1000, MaxDeltaKeys: 150}, 1, t0)
	keys := randomKeys(4, 400)
	for _, k := range keys {
		g.Add(k)
	}
	var got []uint64
	for seq := uint64(1); ; seq++ {
		d, ok := g.TakeDelta()
		if !ok {
			break
		}
		if d.Seq != seq || len(d.Keys) > 150 {
			t.Fatalf("delta seq %d with %d keys, want seq %d ≤150 keys", d.Seq, len(d.Keys), seq)
		}
		got = append(got, d.Keys...)
	}
	if !slices.Equal(got, keys) {
		t.Fatalf("split deltas carry %d keys, want the 400 added in order", len(got))
	}
}

// A random life of a sidecar (adds, removals, clears, rebuilds) streamed to
// a mirror over a lossy, reordering link, with resync on refusal. Whenever
// the mirror has caught up, it must hold every resident key (no false
// negatives) and exactly the sidecar's bits.
func TestMirrorFollowsLossyStream(t *testing.T) {
	for seed := range uint64(8) {
		r := rand.New(rand.NewPCG(seed, 1))
		g := NewGenerations(GenerationConfig{Capacity: 500, MaxDeltaKeys: 40}, 1, t0)
		set := exactSet{}
		var m Mirror
		var inflight []Delta // sent, not yet delivered
		now := t0
		resyncs := 0
		deliver := func(d Delta) {
			if !m.ApplyDelta(d) {
				// The router asks; the sidecar answers with a snapshot.
				st := m.State()
				if st == nil || d.Generation >= st.Generation {
					if err := m.ApplySnapshot(g.Snapshot()); err != nil {
						t.Fatalf("seed %d: resync snapshot refused: %v", seed, err)
					}
					resyncs++
				}
			}
		}
		for step := range 3000 {
			now = now.Add(10 * time.Millisecond)
			switch op := r.IntN(100); {
			case op < 55:
				k := r.Uint64()
				set[k] = true
				g.Add(k)
			case op < 80 && len(set) > 0:
				for k := range set {
					delete(set, k)
					g.Remove(k)
					break
				}
			case op < 81:
				clear(set)
				g.Clear()
			case op < 95:
				if d, ok := g.TakeDelta(); ok {
					switch x := r.IntN(10); {
					case x == 0: // lost
					case x == 1 && len(inflight) > 0: // overtakes the one before
						inflight = append(inflight[:len(inflight)-1], d, inflight[len(inflight)-1])
					default:
						inflight = append(inflight, d)
					}
				}
			default:
				for _, d := range inflight {
					deliver(d)
				}
				inflight = inflight[:0]
			}
			if g.NeedsRebuild(now) {
				g.Rebuild(now, set.keys)
				// The sidecar publishes each new generation's snapshot.
				if r.IntN(4) > 0 {
					if err := m.ApplySnapshot(g.Snapshot()); err != nil {
						t.Fatalf("seed %d step %d: %v", seed, step, err)
					}
				}
			}
			if step%50 == 49 { // quiesce: flush, deliver, check
				for {
					d, ok := g.TakeDelta()
					if !ok {
						break
					}
					inflight = append(inflight, d)
				}
				for _, d := range inflight {
					deliver(d)
				}
				inflight = inflight[:0]
				if st := m.State(); st == nil || st.Generation != g.Stats().Generation || st.Seq != g.Stats().Seq {
					if err := m.ApplySnapshot(g.Snapshot()); err != nil {
						t.Fatal(err)
					}
					resyncs++
				}
				f := m.Filter()
				for k := range set {
					if !f.Test(k) {
						t.Fatalf("seed %d step %d: resident key %x missing at the router", seed, step, k)
					}
				}
				if !slices.Equal(f.AppendWords(nil), g.Snapshot().Words) || m.Keys() != g.Stats().Keys {
					t.Fatalf("seed %d step %d: mirror differs from sidecar (keys %d vs %d)", seed, step, m.Keys(), g.Stats().Keys)
				}
			}
		}
		if resyncs == 0 || g.Stats().Generation < 3 {
			t.Fatalf("seed %d: %d resyncs, %d generations: the stream was too tame", seed, resyncs, g.Stats().Generation)
		}
	}
}

// With nobody taking deltas, pending keys stay bounded; a mirror that
// followed sees the skipped sequence as a gap and resyncs.
func TestUntakenDeltasAreBounded(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 100}, 1, t0)
	var m Mirror
	if err := m.ApplySnapshot(g.Snapshot()); err != nil {
		t.Fatal(err)
	}
	keys := randomKeys(30, 5000)
	for _, k := range keys {
		g.Add(k)
	}
	st := g.Stats()
	if st.Pending > 4096 || st.DroppedDeltas != 1 || st.Seq != 1 {
		t.Fatalf("after 5000 untaken adds: %+v", st)
	}
	d, _ := g.TakeDelta()
	if m.ApplyDelta(d) {
		t.Fatal("delta after dropped keys applied without resync")
	}
	if err := m.ApplySnapshot(g.Snapshot()); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if !m.Filter().Test(k) {
			t.Fatal("resync lost a dropped key")
		}
	}
	if m.Keys() != 5000 {
		t.Fatalf("mirror counts %d keys, want 5000", m.Keys())
	}
}

// The sidecar's event loop adds while its publisher takes deltas and
// snapshots: every key reaches exactly one delta or a later snapshot.
func TestGenerationsConcurrentPublisher(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 20000, MaxDeltaKeys: 150}, 1, t0)
	keys := randomKeys(40, 20000)
	done := make(chan struct{})
	var got []uint64
	go func() {
		defer close(done)
		for {
			d, ok := g.TakeDelta()
			if ok {
				got = append(got, d.Keys...)
				continue
			}
			if g.Stats().Keys == len(keys) {
				return
			}
			_ = g.Snapshot()
			time.Sleep(50 * time.Microsecond)
		}
	}()
	for i, k := range keys {
		g.Add(k)
		if i%5000 == 4999 {
			g.Remove(keys[i-1])
		}
	}
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("publisher never saw every key")
	}
	if !slices.Equal(got, keys) {
		t.Fatalf("deltas carried %d keys, want the %d added, in order", len(got), len(keys))
	}
}

// TestRebuildJobCarriesChangesMadeWhileBuilding: keys added while the
// filter is built outside the owner's lock end up in the new generation;
// removals then count toward the next rebuild.
func TestRebuildJobCarriesChangesMadeWhileBuilding(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 1000}, 1, t0)
	for k := uint64(1); k <= 100; k++ {
		g.Add(k)
	}
	job := g.BeginRebuild()
	copied := exactSet{}
	for k := uint64(1); k <= 100; k++ {
		copied[k] = true
	}
	g.Add(500) // while building
	g.Remove(7)
	job.Build(copied.keys)
	if !g.Install(t0.Add(time.Second), job) {
		t.Fatal("install refused")
	}
	st := g.Stats()
	if st.Generation != 2 || st.Keys != 101 || st.Removed != 1 || st.Pending != 0 {
		t.Fatalf("after install: %+v", st)
	}
	var m Mirror
	if err := m.ApplySnapshot(g.Snapshot()); err != nil {
		t.Fatal(err)
	}
	for _, k := range []uint64{1, 50, 100, 500} {
		if !m.Filter().Test(k) {
			t.Fatalf("key %d missing from the new generation", k)
		}
	}
	if g.Install(t0, job) {
		t.Fatal("a job installed twice")
	}
}

func TestRebuildJobAbandoned(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 1000}, 1, t0)
	g.Add(1)
	job := g.BeginRebuild()
	g.Clear() // the copied keys are all stale now
	job.Build(exactSet{1: true}.keys)
	if g.Install(t0, job) || g.Stats().Generation != 1 || !g.NeedsRebuild(t0) {
		t.Fatal("a job overtaken by a Clear was installed, or the clear was forgotten")
	}
	first := g.BeginRebuild()
	second := g.BeginRebuild()
	first.Build(nil)
	second.Build(nil)
	if g.Install(t0, first) {
		t.Fatal("an older job was installed over a newer one")
	}
	if !g.Install(t0, second) || g.Stats().Generation != 2 {
		t.Fatal("the newest job was not installed")
	}
}

func TestRebuildGrowthStopsAtMaxKeys(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 1000, MaxKeys: 1200}, 1, t0)
	set := exactSet{}
	for _, k := range randomKeys(9, 3000) {
		g.Add(k)
		set[k] = true
	}
	g.Rebuild(t0.Add(time.Second), set.keys)
	if want := NewFilter(1200, 0.01).M(); g.Snapshot().M != want {
		t.Fatalf("3000 live keys, MaxKeys 1200: m=%d, want %d (sized for 1200)", g.Snapshot().M, want)
	}
}
