package fleet

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
)

var t0 = time.Unix(1_800_000_000, 0)

func filterWith(keys ...uint64) *bloom.Filter {
	f := bloom.NewFilter(1024, 0.001)
	for _, k := range keys {
		f.Add(k)
	}
	return f
}

func sidecar(name string) Info {
	return Info{Name: name, Models: []string{"m"}, URL: "http://" + name, Protocol: ProtocolVLLM, KVEvents: true, BlockSize: 16}
}

func TestMatchPrefixUsesOnlyFreshSelectedOnlineFilters(t *testing.T) {
	tb := NewTable(TableConfig{StaleAfter: 300 * time.Millisecond, DropAfter: 750 * time.Millisecond})
	for _, n := range []string{"a", "b", "c"} {
		tb.Upsert(sidecar(n), t0)
	}
	tb.AddStatic("s", "http://static", []string{"m"})
	tb.SetFilter("a", filterWith(1, 2, 3), 1, 3, t0)
	tb.SetFilter("b", filterWith(1, 2), 1, 2, t0)
	tb.SetFilter("c", filterWith(1), 1, 1, t0)

	s := tb.Snapshot()
	if got := len(s.Replicas); got != 4 {
		t.Fatalf("%d replicas", got)
	}
	matched := make([]int, len(s.Replicas))
	s.MatchPrefix([]uint64{1, 2, 3, 4}, matched)
	if want := []int{3, 2, 1, 0}; fmt.Sprint(matched) != fmt.Sprint(want) {
		t.Fatalf("matched %v, want %v", matched, want)
	}
	if r := s.Replicas[s.Find("s")]; r.Protocol != ProtocolStatic || !r.Online || r.KVEvents {
		t.Fatalf("static replica %+v", r)
	}

	// Selection: only a and c match.
	if err := tb.Select([]string{"a", "c"}); err != nil {
		t.Fatal(err)
	}
	s = tb.Snapshot()
	s.MatchPrefix([]uint64{1, 2, 3, 4}, matched)
	if want := []int{3, 0, 1, 0}; fmt.Sprint(matched) != fmt.Sprint(want) {
		t.Fatalf("selected: matched %v, want %v", matched, want)
	}
	if s.Replicas[1].Selected || !s.Replicas[0].Selected {
		t.Fatal("Selected flags wrong")
	}
	if err := tb.Select([]string{"a"}); err == nil {
		t.Fatal("a selection of one replica accepted")
	}
	if err := tb.Select(nil); err != nil {
		t.Fatal(err)
	}

	// a keeps talking, b and c fall silent: stale at 300 ms, matched by load only.
	tb.SetLoad("a", Load{Waiting: 1}, true, t0.Add(250*time.Millisecond))
	if off := tb.Expire(t0.Add(400 * time.Millisecond)); len(off) != 0 {
		t.Fatalf("offline too early: %v", off)
	}
	s = tb.Snapshot()
	s.MatchPrefix([]uint64{1, 2, 3, 4}, matched)
	if want := []int{3, 0, 0, 0}; fmt.Sprint(matched) != fmt.Sprint(want) {
		t.Fatalf("stale: matched %v, want %v", matched, want)
	}
	if !s.Replicas[1].Stale || s.Replicas[0].Stale || !s.Replicas[1].Online {
		t.Fatalf("stale flags: %+v", s.Replicas[:2])
	}
	// Silent past DropAfter: orphans, filter gone, still routed by load.
	off := tb.Expire(t0.Add(800 * time.Millisecond))
	if fmt.Sprint(off) != "[b c]" {
		t.Fatalf("orphaned %v, want [b c]", off)
	}
	s = tb.Snapshot()
	if r := s.Replicas[1]; !r.Online || !r.Orphan || !r.Stale || r.Filter != nil || r.FilterGeneration != 0 {
		t.Fatalf("silent replica: %+v", r)
	}
	// Heard again: no orphan, but no filter until a snapshot arrives.
	tb.SetLoad("b", Load{}, true, t0.Add(900*time.Millisecond))
	s = tb.Snapshot()
	if r := s.Replicas[1]; !r.Online || r.Orphan || r.Stale || r.Filter != nil {
		t.Fatalf("back: %+v", r)
	}
}

// TestOrphanIsRoutedWhileItsEngineAnswers: a replica whose sidecar failed
// keeps serving by load, goes offline when its engine stops answering the
// router's probes, back online when it answers again, and is forgotten
// after ForgetOrphanAfter without an answer. A sidecar heard again ends it.
func TestOrphanIsRoutedWhileItsEngineAnswers(t *testing.T) {
	tb := NewTable(TableConfig{ForgetOrphanAfter: 10 * time.Second})
	tb.Upsert(sidecar("a"), t0)
	tb.SetFilter("a", filterWith(7), 3, 1, t0)
	tb.SetLoad("a", Load{Waiting: 9, Running: 4}, true, t0)
	if !tb.Orphan("a", t0.Add(time.Second)) || tb.Orphan("nope", t0) {
		t.Fatal("Orphan's report")
	}
	r := tb.Snapshot().Replicas[0]
	if !r.Online || !r.Orphan || !r.Stale || r.Filter != nil || r.Load != (Load{}) {
		t.Fatalf("orphan: %+v", r)
	}
	tb.OrphanProbed("a", false, t0.Add(2*time.Second))
	if r := tb.Snapshot().Replicas[0]; r.Online {
		t.Fatal("engine not answering, still online")
	}
	tb.OrphanProbed("a", true, t0.Add(3*time.Second))
	if r := tb.Snapshot().Replicas[0]; !r.Online {
		t.Fatal("engine answering again, still offline")
	}
	if !tb.OrphanProbed("a", false, t0.Add(12*time.Second)) {
		t.Fatal("forgotten 9 s after its last answer")
	}
	if tb.OrphanProbed("a", false, t0.Add(13*time.Second)) || len(tb.Snapshot().Replicas) != 0 {
		t.Fatal("not forgotten 10 s after its last answer")
	}
	// The sidecar is back before that: no orphan, probes change nothing.
	tb.Upsert(sidecar("b"), t0)
	tb.Orphan("b", t0)
	tb.SetLoad("b", Load{Waiting: 1}, true, t0.Add(time.Second))
	if tb.OrphanProbed("b", false, t0.Add(time.Minute)) {
		t.Fatal("a replica whose sidecar is back was probed")
	}
	if r := tb.Snapshot().Replicas[0]; !r.Online || r.Orphan || r.Load.Waiting != 1 {
		t.Fatalf("back: %+v", r)
	}
}

func TestUnhealthyEngineGoesOfflineAtOnce(t *testing.T) {
	tb := NewTable(TableConfig{})
	tb.Upsert(sidecar("a"), t0)
	tb.SetFilter("a", filterWith(7), 3, 1, t0)
	tb.SetLoad("a", Load{Running: 2}, false, t0.Add(time.Millisecond))
	r := tb.Snapshot().Replicas[0]
	if r.Online || r.Filter != nil || r.Load.Running != 2 {
		t.Fatalf("%+v", r)
	}
	tb.SetLoad("a", Load{}, true, t0.Add(2*time.Millisecond))
	if r := tb.Snapshot().Replicas[0]; !r.Online {
		t.Fatal("healthy again but offline")
	}
}

func TestClearRoutesDropsFiltersUntilNextSnapshot(t *testing.T) {
	tb := NewTable(TableConfig{})
	for _, n := range []string{"a", "b"} {
		tb.Upsert(sidecar(n), t0)
		tb.SetFilter(n, filterWith(1), 2, 1, t0)
	}
	tb.AddStatic("s", "http://s", nil)
	if got := tb.ClearRoutes([]string{"b", "nope"}); fmt.Sprint(got) != "[b]" {
		t.Fatalf("cleared %v", got)
	}
	s := tb.Snapshot()
	if s.Replicas[0].Filter == nil || s.Replicas[1].Filter != nil {
		t.Fatal("clear of b touched the wrong filters")
	}
	if got := tb.ClearRoutes(nil); fmt.Sprint(got) != "[a b]" {
		t.Fatalf("cleared %v", got)
	}
	tb.SetFilter("a", filterWith(1), 3, 1, t0)
	if r := tb.Snapshot().Replicas[0]; r.FilterGeneration != 3 || r.Filter == nil {
		t.Fatalf("%+v", r)
	}
}

func TestFirstAnnouncedBlockSizeKeepsFilter(t *testing.T) {
	tb := NewTable(TableConfig{})
	info := sidecar("a")
	info.BlockSize = 0 // not learned from events yet
	tb.Upsert(info, t0)
	tb.SetFilter("a", filterWith(1), 1, 1, t0)
	info.BlockSize = 16
	tb.Upsert(info, t0)
	if r := tb.Snapshot().Replicas[0]; r.Filter == nil || r.BlockSize != 16 {
		t.Fatalf("learning the block size dropped the filter: %+v", r)
	}
}

func TestBlockSizeChangeDropsFilter(t *testing.T) {
	tb := NewTable(TableConfig{})
	tb.Upsert(sidecar("a"), t0)
	tb.SetFilter("a", filterWith(1), 1, 1, t0)
	info := sidecar("a")
	info.BlockSize = 32
	tb.Upsert(info, t0)
	if r := tb.Snapshot().Replicas[0]; r.Filter != nil || r.BlockSize != 32 {
		t.Fatalf("%+v", r)
	}
	if !tb.Remove("a") || tb.Remove("a") || len(tb.Snapshot().Replicas) != 0 {
		t.Fatal("remove")
	}
}

func TestSnapshotIsStableWhileTableChanges(t *testing.T) {
	tb := NewTable(TableConfig{})
	tb.Upsert(sidecar("a"), t0)
	s1 := tb.Snapshot()
	if s2 := tb.Snapshot(); s1 != s2 {
		t.Fatal("unchanged table rebuilt its snapshot")
	}
	tb.SetLoad("a", Load{Waiting: 5}, true, t0)
	if s1.Replicas[0].Load.Waiting != 0 || tb.Snapshot().Replicas[0].Load.Waiting != 5 {
		t.Fatal("snapshot not immutable or not refreshed")
	}
}

func TestConcurrentReadersAndWriters(t *testing.T) {
	tb := NewTable(TableConfig{})
	for i := range 50 {
		tb.Upsert(sidecar(fmt.Sprint("r", i)), t0)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			keys := []uint64{1, 2, 3}
			matched := make([]int, 0, 64)
			for {
				select {
				case <-stop:
					return
				default:
				}
				s := tb.Snapshot()
				matched = matched[:len(s.Replicas)]
				s.MatchPrefix(keys, matched)
			}
		}()
	}
	for i := range 500 {
		n := fmt.Sprint("r", i%50)
		tb.SetLoad(n, Load{Running: i}, true, t0.Add(time.Duration(i)*time.Millisecond))
		if i%10 == 0 {
			tb.SetFilter(n, filterWith(1, 2), uint64(i), 2, t0.Add(time.Duration(i)*time.Millisecond))
		}
	}
	close(stop)
	wg.Wait()
}

func BenchmarkSnapshotMatchPrefix50x256(b *testing.B) {
	tb := NewTable(TableConfig{})
	keys := make([]uint64, 256)
	for i := range keys {
		keys[i] = uint64(i+1) * 0x9e3779b97f4a7c15
	}
	for i := range 50 {
		n := fmt.Sprint("r", i)
		tb.Upsert(sidecar(n), t0)
		f := bloom.NewFilter(300_000, 0.01)
		for _, k := range keys[:i*5] {
			f.Add(k)
		}
		tb.SetFilter(n, f, 1, i*5, t0)
	}
	matched := make([]int, 50)
	b.ReportAllocs()
	for b.Loop() {
		tb.Snapshot().MatchPrefix(keys, matched)
	}
}

// TestStaticReaddedAtSameURLKeepsLearnedModels: a config reload re-adds
// every static; one whose models were learned keeps them (else it would take
// any model until rediscovery answers), unless its URL changed.
func TestStaticReaddedAtSameURLKeepsLearnedModels(t *testing.T) {
	tb := NewTable(TableConfig{})
	tb.AddStatic("s", "http://s", nil)
	if !tb.LearnStatic("s", "http://s", []string{"a", "b"}) {
		t.Fatal("models of a static added without models not learned")
	}
	tb.AddStatic("s", "http://s", nil)
	if r := tb.Snapshot().Replicas[0]; fmt.Sprint(r.Models) != "[a b]" || !r.ModelsLearned {
		t.Fatalf("re-added at the same URL: models %v, learned %v", r.Models, r.ModelsLearned)
	}
	tb.AddStatic("s", "http://elsewhere", nil)
	if r := tb.Snapshot().Replicas[0]; len(r.Models) != 0 || r.ModelsLearned {
		t.Fatalf("re-added at another URL: models %v, learned %v", r.Models, r.ModelsLearned)
	}
}

// TestConfiguredStaticModelsAreNeverOverwrittenByLearning: once a static is
// given models, what it was learned to serve is forgotten and learning (an
// answer to a question asked before the reload included) changes nothing.
func TestConfiguredStaticModelsAreNeverOverwrittenByLearning(t *testing.T) {
	tb := NewTable(TableConfig{})
	tb.AddStatic("s", "http://s", nil)
	tb.LearnStatic("s", "http://s", []string{"a", "b"})
	tb.AddStatic("s", "http://s", []string{"a"})
	if tb.LearnStatic("s", "http://s", []string{"a", "b"}) {
		t.Error("learning overrode configured models")
	}
	if r := tb.Snapshot().Replicas[0]; fmt.Sprint(r.Models) != "[a]" || r.ModelsLearned {
		t.Fatalf("configured [a]: models %v, learned %v", r.Models, r.ModelsLearned)
	}
	// Configured without models again: it takes any model until relearned.
	tb.AddStatic("s", "http://s", nil)
	if r := tb.Snapshot().Replicas[0]; len(r.Models) != 0 || !tb.LearnStatic("s", "http://s", []string{"b"}) {
		t.Fatalf("models configuration dropped: models %v, or not learnable", r.Models)
	}
}

// TestLearnStaticIgnoresUpstreamsReloadedAway: an answer for a static that a
// reload removed, moved to another URL or replaced by a sidecar's replica
// changes nothing (and does not bring the static back).
func TestLearnStaticIgnoresUpstreamsReloadedAway(t *testing.T) {
	tb := NewTable(TableConfig{})
	tb.AddStatic("gone", "http://gone", nil)
	tb.RemoveStatic(nil)
	tb.AddStatic("moved", "http://new", nil)
	tb.Upsert(sidecar("a"), t0)
	for name, url := range map[string]string{"gone": "http://gone", "moved": "http://old", "a": "http://a"} {
		if tb.LearnStatic(name, url, []string{"x"}) {
			t.Errorf("learned models for %s at %s", name, url)
		}
	}
	s := tb.Snapshot()
	if len(s.Replicas) != 2 || s.Find("gone") >= 0 || len(s.Replicas[s.Find("moved")].Models) != 0 || fmt.Sprint(s.Replicas[s.Find("a")].Models) != "[m]" {
		t.Fatalf("%+v", s.Replicas)
	}
}

// BenchmarkSnapshotAfterLoad1024 is a busy router's table: every load
// record changes it, and the next request's Snapshot rebuilds it.
func BenchmarkSnapshotAfterLoad1024(b *testing.B) {
	tb := NewTable(TableConfig{})
	for i := range 1024 {
		tb.Upsert(sidecar(fmt.Sprint("replica-", i)), t0)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		tb.SetLoad(fmt.Sprint("replica-", i%1024), Load{Running: i}, true, t0)
		if len(tb.Snapshot().Replicas) != 1024 {
			b.Fatal("lost a replica")
		}
		i++
	}
}

// TestSnapshotOrderFollowsMembership: replicas coming and going between
// rebuilds keep every snapshot sorted by name with exactly the members.
func TestSnapshotOrderFollowsMembership(t *testing.T) {
	tb := NewTable(TableConfig{})
	names := func() string {
		var out []string
		for _, r := range tb.Snapshot().Replicas {
			out = append(out, r.Name)
		}
		return strings.Join(out, ",")
	}
	tb.Upsert(sidecar("c"), t0)
	tb.Upsert(sidecar("a"), t0)
	if got := names(); got != "a,c" {
		t.Fatalf("after two joins: %s", got)
	}
	tb.SetLoad("c", Load{Running: 1}, true, t0)
	tb.Upsert(sidecar("b"), t0)
	tb.AddStatic("s", "http://s", nil)
	if got := names(); got != "a,b,c,s" {
		t.Fatalf("after a join and a static: %s", got)
	}
	tb.Remove("a")
	tb.RemoveStatic(nil)
	if got := names(); got != "b,c" {
		t.Fatalf("after a leave and a reload without statics: %s", got)
	}
	tb.AddStatic("b", "http://b", []string{"m"}) // replaces the sidecar's entry
	tb.SetLoad("b", Load{Running: 2}, true, t0)  // refused: b is static now
	if r := tb.Snapshot().Replicas[0]; r.Name != "b" || r.Protocol != ProtocolStatic || names() != "b,c" {
		t.Fatalf("after b turned static: %+v, %s", r, names())
	}
	tb.Orphan("c", t0)
	tb.OrphanProbed("c", false, t0.Add(2*time.Minute))
	if got := names(); got != "b" {
		t.Fatalf("after c's orphan was forgotten: %s", got)
	}
}

// TestSnapshotRebuiltFromThePreviousIsAFreshOne: a snapshot that copies
// the previous one (or, recycled, an older one) and rewrites the entries
// changed since equals one built afresh from every entry, through every
// kind of change.
func TestSnapshotRebuiltFromThePreviousIsAFreshOne(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	tb := NewTable(TableConfig{})
	name := func() string { return fmt.Sprint("replica-", rng.IntN(40)) }
	now := t0
	f := filterWith(1, 2, 3)
	for i := range 40 {
		tb.Upsert(sidecar(fmt.Sprint("replica-", i)), now)
	}
	for step := range 20000 {
		now = now.Add(time.Duration(rng.IntN(200)) * time.Millisecond)
		switch op := rng.IntN(100); {
		case op < 40:
			tb.SetLoad(name(), Load{Running: rng.IntN(9), Waiting: rng.IntN(3)}, rng.IntN(50) > 0, now)
		case op < 60:
			tb.SetFilter(name(), f, uint64(step), step, now)
		case op < 75:
			tb.Heard(name(), now)
		case op < 80:
			tb.Expire(now)
		case op < 83:
			tb.Orphan(name(), now)
		case op < 86:
			tb.OrphanProbed(name(), rng.IntN(2) == 0, now)
		case op < 88:
			tb.ClearRoutes([]string{name()})
		case op < 89:
			if rng.IntN(2) == 0 {
				_ = tb.Select(nil)
			} else {
				_ = tb.Select([]string{name(), name(), name()})
			}
		case op < 92:
			tb.Upsert(sidecar(name()), now)
		case op < 94:
			tb.Remove(name())
		case op < 95:
			tb.AddStatic(name(), "http://static", nil)
		}
		if rng.IntN(4) > 0 {
			continue
		}
		// Both rebuilt now: an unchanged table keeps its snapshot, whose
		// UpdatedAt may predate a Heard.
		tb.mu.Lock()
		tb.changedLocked()
		tb.mu.Unlock()
		got := tb.Snapshot()
		want := freshSnapshot(tb)
		if !reflect.DeepEqual(got.Replicas, want.Replicas) || !slices.Equal(got.filters, want.filters) {
			for i := range want.Replicas {
				if i >= len(got.Replicas) || !reflect.DeepEqual(got.Replicas[i], want.Replicas[i]) || got.filters[i] != want.filters[i] {
					t.Fatalf("step %d, replica %d of %d: rebuilt from the previous snapshot\n%#v\nafresh\n%#v", step, i, len(want.Replicas), got.Replicas[min(i, len(got.Replicas)-1)], want.Replicas[i])
				}
			}
			t.Fatalf("step %d: %d replicas rebuilt from the previous snapshot, %d afresh", step, len(got.Replicas), len(want.Replicas))
		}
		if rng.IntN(3) > 0 {
			tb.Recycle(got)
		}
	}
}

// freshSnapshot is what the table's snapshot holds, built from every entry.
func freshSnapshot(tb *Table) *Snapshot {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	var s Snapshot
	for _, e := range tb.entries {
		r := e.r
		r.Selected = tb.selection == nil || tb.selection[r.Name]
		s.Replicas = append(s.Replicas, r)
	}
	slices.SortFunc(s.Replicas, func(a, b Replica) int { return strings.Compare(a.Name, b.Name) })
	for _, r := range s.Replicas {
		var f *bloom.Filter
		if r.Online && r.Selected && r.KVEvents && !r.Stale {
			f = r.Filter
		}
		s.filters = append(s.filters, f)
	}
	return &s
}
