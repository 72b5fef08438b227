package residentset

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/kvevents"
)

// recorder is an Observer that keeps the set its calls describe and fails
// on a call that does not change it.
type recorder struct {
	t     testing.TB
	keys  map[uint64]bool
	log   []string
	clear int
}

func newRecorder(t testing.TB) *recorder { return &recorder{t: t, keys: map[uint64]bool{}} }

func (r *recorder) Added(k uint64) {
	if r.keys[k] {
		r.t.Fatalf("Added(%x) for a resident key", k)
	}
	r.keys[k] = true
	r.log = append(r.log, fmt.Sprintf("+%x", k))
}

func (r *recorder) Removed(k uint64) {
	if !r.keys[k] {
		r.t.Fatalf("Removed(%x) for a key not resident", k)
	}
	delete(r.keys, k)
	r.log = append(r.log, fmt.Sprintf("-%x", k))
}

func (r *recorder) Cleared() {
	clear(r.keys)
	r.clear++
	r.log = append(r.log, "clear")
}

func stored(hashes []uint64, parent *uint64, tokens []uint32) *kvevents.Event {
	ev := &kvevents.Event{Kind: kvevents.KindBlockStored, BlockHashes: hashes, TokenIDs: tokens, BlockSize: 4}
	if parent != nil {
		ev.ParentHash, ev.HasParent = *parent, true
	}
	return ev
}

func removed(hashes ...uint64) *kvevents.Event {
	return &kvevents.Event{Kind: kvevents.KindBlockRemoved, BlockHashes: hashes}
}

func ptr(v uint64) *uint64 { return &v }

func seq(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// routerKeys are the keys a router computes for tokens of the base model.
func routerKeys(tokens []uint32) []uint64 {
	return blockkey.Append(nil, blockkey.Seed("", ""), tokens, 4)
}

func wantSet(t *testing.T, s *Set, rec *recorder, want ...uint64) {
	t.Helper()
	got := s.AppendKeys(nil)
	slices.Sort(got)
	want = slices.Clone(want)
	slices.Sort(want)
	want = slices.Compact(want)
	if !slices.Equal(got, want) || s.Len() != len(want) {
		t.Fatalf("resident keys %x (Len %d), want %x", got, s.Len(), want)
	}
	if obs := slices.Sorted(maps.Keys(rec.keys)); !slices.Equal(obs, want) {
		t.Fatalf("observer saw %x, want %x", obs, want)
	}
}

func TestScriptedSequence(t *testing.T) {
	s, rec := New(Options{}), newRecorder(t)
	prompt := seq(1, 16) // 4 blocks
	k := routerKeys(prompt)

	// Two blocks stored from the start, then two more chained on them; a
	// trailing partial chunk of tokens is not a block.
	s.Apply(stored([]uint64{10, 11}, nil, prompt[:8]), rec)
	s.Apply(stored([]uint64{12, 13}, ptr(11), append(slices.Clone(prompt[8:16]), 99, 98)), rec)
	wantSet(t, s, rec, k...)
	if s.BlockSize() != 4 {
		t.Fatalf("BlockSize %d, want 4", s.BlockSize())
	}

	// The same hash stored twice needs two removals.
	s.Apply(stored([]uint64{13}, ptr(12), prompt[12:16]), rec)
	s.Apply(removed(13), rec)
	wantSet(t, s, rec, k...)
	s.Apply(removed(13), rec)
	wantSet(t, s, rec, k[:3]...)

	// Another engine hash for the same block (e.g. extra keys kvmesh does
	// not see): the key stays until both are gone.
	s.Apply(stored([]uint64{20}, ptr(11), prompt[8:12]), rec)
	s.Apply(removed(12), rec)
	wantSet(t, s, rec, k[:3]...)
	s.Apply(removed(20), rec)
	wantSet(t, s, rec, k[:2]...)

	// Unknown parent: an orphan, nothing stored, nothing guessed.
	s.Apply(stored([]uint64{30, 31}, ptr(999), seq(50, 8)), rec)
	// Removal of an unknown hash: counted and ignored.
	s.Apply(removed(31, 777), rec)
	wantSet(t, s, rec, k[:2]...)
	st := s.Stats()
	if s.Orphans() != 2 || st.UnknownRemovals != 2 || st.Duplicates != 1 {
		t.Fatalf("orphans %d, unknown removals %d, duplicates %d; want 2, 2, 1", s.Orphans(), st.UnknownRemovals, st.Duplicates)
	}

	// A child can outlive its parent's removal and still key its children.
	s.Apply(removed(10), rec)
	s.Apply(stored([]uint64{12}, ptr(11), prompt[8:12]), rec)
	wantSet(t, s, rec, k[1], k[2])

	// Everything cleared; the old chain is unknown afterwards.
	s.Apply(&kvevents.Event{Kind: kvevents.KindAllBlocksCleared}, rec)
	wantSet(t, s, rec)
	s.Apply(stored([]uint64{13}, ptr(12), prompt[12:16]), rec)
	wantSet(t, s, rec)
	if rec.clear != 1 || s.Orphans() != 3 {
		t.Fatalf("clears %d orphans %d, want 1, 3", rec.clear, s.Orphans())
	}
	s.Reset(rec)
	if rec.clear != 2 || s.Stats().Resets != 1 {
		t.Fatal("Reset did not clear through the observer")
	}
}

func TestLoRAAndMediaAndGroups(t *testing.T) {
	s, rec := New(Options{}), newRecorder(t)
	tokens := seq(7, 4)
	lora := stored([]uint64{1}, nil, tokens)
	lora.LoRAName = "sql-adapter"
	s.Apply(lora, rec)
	byID := stored([]uint64{2}, nil, tokens)
	byID.LoRAID = 42
	s.Apply(byID, rec)
	base := stored([]uint64{3}, nil, tokens)
	base.Medium = "GPU"
	s.Apply(base, rec)
	cpu := stored([]uint64{4}, nil, seq(100, 4))
	cpu.Medium = "CPU"
	s.Apply(cpu, rec)
	// Group 1 of a hybrid model stores the same block: same key, own refs.
	group := stored([]uint64{3}, nil, tokens)
	group.GroupIdx = 1
	s.Apply(group, rec)

	kLoRA := blockkey.Next(blockkey.Seed("sql-adapter", ""), tokens)
	kID := blockkey.Next(blockkey.Seed("42", ""), tokens)
	kBase := blockkey.Next(blockkey.Seed("", ""), tokens)
	wantSet(t, s, rec, kLoRA, kID, kBase)
	if s.Stats().OtherMedia != 1 {
		t.Fatalf("CPU blocks ignored: %d, want 1", s.Stats().OtherMedia)
	}
	s.Apply(removed(3), rec) // group 0 only
	wantSet(t, s, rec, kLoRA, kID, kBase)
	g1 := removed(3)
	g1.GroupIdx = 1
	s.Apply(g1, rec)
	wantSet(t, s, rec, kLoRA, kID)

	// With CPU counted too, an offload event without tokens takes the key
	// the same engine hash has on the GPU.
	s2, rec2 := New(Options{Media: []string{"gpu", "cpu"}}), newRecorder(t)
	s2.Apply(stored([]uint64{5}, nil, tokens), rec2)
	off := stored([]uint64{5}, nil, nil)
	off.Medium = "CPU"
	s2.Apply(off, rec2)
	s2.Apply(removed(5), rec2)
	wantSet(t, s2, rec2, kBase)
	noTokens := stored([]uint64{6, 7}, ptr(5), seq(1, 4)) // second block has no tokens
	s2.Apply(noTokens, rec2)
	if s2.Stats().Unkeyed != 1 || s2.Len() != 2 {
		t.Fatalf("unkeyed %d len %d, want 1, 2", s2.Stats().Unkeyed, s2.Len())
	}
}

// TestLoRANamesForIDOnlyEvents: vLLM before v0.14 names the adapter only by
// lora_id; with the id's name configured, its blocks get the keys a router
// seeds with that name.
func TestLoRANamesForIDOnlyEvents(t *testing.T) {
	s, rec := New(Options{LoRANames: map[int64]string{42: "sql-adapter"}}), newRecorder(t)
	tokens := seq(7, 4)
	byID := stored([]uint64{1}, nil, tokens)
	byID.LoRAID = 42
	s.Apply(byID, rec)
	unknown := stored([]uint64{2}, nil, tokens)
	unknown.LoRAID = 7 // not configured: keyed by the id, as before
	s.Apply(unknown, rec)
	wantSet(t, s, rec, blockkey.Next(blockkey.Seed("sql-adapter", ""), tokens), blockkey.Next(blockkey.Seed("7", ""), tokens))
}

// model is the reference: engine hashes with their true keys and
// reference counts per group, resident keys derived by brute force.
type model struct {
	keyOf map[uint64]uint64   // engine hash → key, fixed at creation
	refs  map[[2]uint64]int   // (group, hash) → stores not removed
	toks  map[uint64][]uint32 // engine hash → its block's tokens
}

func (m *model) keys() []uint64 {
	var out []uint64
	for gh, n := range m.refs {
		if n > 0 {
			out = append(out, m.keyOf[gh[1]])
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// tiersLen counts the entries of every tier, checking none is kept empty.
func tiersLen(s *Set) int {
	n := 0
	for _, t := range s.tiers {
		if t.len() == 0 {
			return -1
		}
		n += t.len()
	}
	return n
}

// TestAgainstReferenceModel drives the set with random valid event streams
// (multi-block stores chained on resident parents, duplicates, aliases,
// removals, clears, orphans, other media) and compares it with the model
// after every event.
func TestAgainstReferenceModel(t *testing.T) {
	var dups, aliases uint64
	for seed := range uint64(12) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 99))
			s, rec := New(Options{}), newRecorder(t)
			m := &model{keyOf: map[uint64]uint64{}, refs: map[[2]uint64]int{}, toks: map[uint64][]uint32{}}
			nextHash := uint64(1)
			orphans := uint64(0)
			var resident [][2]uint64 // candidates, may hold stale entries
			pickResident := func() ([2]uint64, bool) {
				for range 8 {
					if len(resident) == 0 {
						break
					}
					gh := resident[r.IntN(len(resident))]
					if m.refs[gh] > 0 {
						return gh, true
					}
				}
				return [2]uint64{}, false
			}
			for range 1500 {
				switch op := r.IntN(100); {
				case op < 50: // store 1-4 blocks, from the root or on a resident parent
					group := uint64(r.IntN(2))
					ev := &kvevents.Event{Kind: kvevents.KindBlockStored, BlockSize: 4, GroupIdx: int(group)}
					parentKey := blockkey.Seed("", "")
					if r.IntN(4) == 0 {
						ev.LoRAName = []string{"a", "b"}[r.IntN(2)]
						parentKey = blockkey.Seed(ev.LoRAName, "")
					} else if gh, ok := pickResident(); ok && gh[0] == group {
						ev.ParentHash, ev.HasParent = gh[1], true
						parentKey = m.keyOf[gh[1]]
					}
					for range 1 + r.IntN(4) {
						block := []uint32{uint32(r.IntN(3)), uint32(r.IntN(3)), 1, 2} // tiny alphabet: repeats
						key := blockkey.Next(parentKey, block)
						var h uint64
						switch {
						case r.IntN(5) == 0 && len(resident) > 0 && ev.LoRAName == "" && !ev.HasParent:
							// duplicate store of an existing hash with its own content
							gh := resident[r.IntN(len(resident))]
							h, key, block = gh[1], m.keyOf[gh[1]], m.toks[gh[1]]
							if !slices.Equal(blockkey.Append(nil, parentKey, block, 4), []uint64{key}) {
								// its parent differs: not a valid duplicate here, make a new hash
								h, key = nextHash, blockkey.Next(parentKey, block)
								nextHash++
							}
						default:
							h = nextHash // a new hash; same content may give the same key (alias)
							nextHash++
						}
						m.keyOf[h], m.toks[h] = key, block
						m.refs[[2]uint64{group, h}]++
						resident = append(resident, [2]uint64{group, h})
						ev.BlockHashes = append(ev.BlockHashes, h)
						ev.TokenIDs = append(ev.TokenIDs, block...)
						parentKey = key
					}
					s.Apply(ev, rec)
				case op < 85: // remove 1-3 resident blocks, sometimes an unknown one
					ev := &kvevents.Event{Kind: kvevents.KindBlockRemoved}
					group := uint64(r.IntN(2))
					ev.GroupIdx = int(group)
					for range 1 + r.IntN(3) {
						if gh, ok := pickResident(); ok && gh[0] == group && r.IntN(10) > 0 {
							m.refs[gh]--
							ev.BlockHashes = append(ev.BlockHashes, gh[1])
						} else {
							ev.BlockHashes = append(ev.BlockHashes, 1<<40+uint64(r.IntN(1000)))
						}
					}
					s.Apply(ev, rec)
				case op < 92: // orphan: parent never seen
					n := 1 + r.IntN(3)
					ev := stored(nil, ptr(1<<50+uint64(r.IntN(1000))), make([]uint32, 4*n))
					for range n {
						ev.BlockHashes = append(ev.BlockHashes, nextHash)
						nextHash++
					}
					orphans += uint64(n)
					s.Apply(ev, rec)
				case op < 99: // another medium: ignored
					ev := stored([]uint64{nextHash}, nil, seq(0, 4))
					nextHash++
					ev.Medium = "CPU"
					s.Apply(ev, rec)
				default:
					clear(m.refs)
					resident = resident[:0]
					s.Apply(&kvevents.Event{Kind: kvevents.KindAllBlocksCleared}, rec)
				}
				wantSet(t, s, rec, m.keys()...)
				held := 0
				for gh, n := range m.refs {
					if n > 0 && gh[0] < 2 {
						held++
					}
				}
				if s.Blocks() != held || s.Blocks() != tiersLen(s) {
					t.Fatalf("Blocks %d, tiers hold %d, model %d", s.Blocks(), tiersLen(s), held)
				}
			}
			if s.Orphans() != orphans {
				t.Fatalf("orphans %d, want %d", s.Orphans(), orphans)
			}
			dups += s.Stats().Duplicates
			aliases += uint64(len(s.keys.extra))
		})
	}
	// The generator must exercise what it is for.
	if dups == 0 || aliases == 0 {
		t.Fatalf("streams had %d duplicate stores and %d aliased keys at the end; want both > 0", dups, aliases)
	}
	t.Logf("%d duplicate stores, %d aliased keys at the end", dups, aliases)
}
