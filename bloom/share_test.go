package bloom

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestSharedMirrorsSeeWhatTheirOwnWouldSee: mirrors of one stream that
// share their bits (Share) answer every probe and prefix walk as mirrors
// with bits of their own fed the same messages do, whichever deltas each
// has applied, lost or replaced by a later snapshot.
func TestSharedMirrorsSeeWhatTheirOwnWouldSee(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	g := NewGenerations(GenerationConfig{Capacity: 4000, MaxDeltaKeys: 40}, 1, t0)
	const n = 6
	share := NewShare()
	shared, own := make([]Mirror, n), make([]Mirror, n)
	var deltas []Delta // this generation's, by seq - 1 - base
	var base uint64    // the generation's first delta's seq - 1
	var snapPayload []byte
	var snapSeq uint64
	next := make([]uint64, n) // the next delta seq each mirror will get
	probes := randomKeys(21, 200)
	sendSnapshot := func(i int) {
		if err := func() error {
			s, err := share.DecodeSharedSnapshot("sidecar", snapPayload)
			if err != nil {
				return err
			}
			o, err := DecodeSnapshot(snapPayload)
			if err != nil {
				return err
			}
			if (shared[i].ApplySnapshot(s) == nil) != (own[i].ApplySnapshot(o) == nil) {
				t.Fatal("a shared mirror and its own disagree on a snapshot")
			}
			return nil
		}(); err != nil {
			t.Fatal(err)
		}
		next[i] = snapSeq + 1
	}
	takeSnapshot := func() {
		s := g.Snapshot()
		snapPayload, snapSeq = s.AppendBinary(nil), s.Seq
	}
	takeSnapshot()
	for i := range n {
		sendSnapshot(i)
	}
	keys := randomKeys(31, 100000)
	for step := range 3000 {
		switch op := rng.IntN(20); {
		case op < 8: // the sidecar adds keys and cuts a delta
			for range 1 + rng.IntN(30) {
				g.Add(keys[0])
				keys = keys[1:]
			}
			if d, ok := g.TakeDelta(); ok {
				deltas = append(deltas, d)
			}
		case op < 16: // a mirror takes its next delta, or loses it
			i := rng.IntN(n)
			k := int(next[i] - 1 - base)
			if k < 0 || k >= len(deltas) {
				continue
			}
			if rng.IntN(15) == 0 {
				next[i]++ // lost: every later delta is refused
				continue
			}
			a, b := shared[i].ApplyDelta(deltas[k]), own[i].ApplyDelta(deltas[k])
			if a != b {
				t.Fatalf("step %d: mirror %d applied a delta shared %v, own %v", step, i, a, b)
			}
			if a {
				next[i]++
			}
		case op < 18: // a mirror asks for the current snapshot
			if rng.IntN(3) == 0 {
				takeSnapshot()
			}
			sendSnapshot(rng.IntN(n))
		case op < 19: // the sidecar rebuilds: a new generation
			g.Rebuild(t0, func(yield func(uint64) bool) {
				for _, k := range randomKeys(uint64(step), 500) {
					if !yield(k) {
						return
					}
				}
			})
			deltas = nil
			takeSnapshot()
			base = snapSeq
			for i := range n {
				if rng.IntN(4) > 0 {
					sendSnapshot(i)
				}
			}
		default:
			i := rng.IntN(n)
			shared[i].Reset()
			own[i].Reset()
		}
		for i := range n {
			fs, fo := shared[i].Filter(), own[i].Filter()
			if (fs == nil) != (fo == nil) {
				t.Fatalf("step %d: mirror %d holds a filter shared %v, own %v", step, i, fs != nil, fo != nil)
			}
			if fs == nil {
				continue
			}
			for _, k := range append(probes, deltaKeys(deltas)...) {
				if fs.Test(k) != fo.Test(k) {
					t.Fatalf("step %d: mirror %d answers %x shared %v, own %v", step, i, k, fs.Test(k), fo.Test(k))
				}
			}
			walk := deltaKeys(deltas)
			var ms, mo [1]int
			MatchPrefix(walk, []*Filter{fs}, ms[:])
			MatchPrefix(walk, []*Filter{fo}, mo[:])
			if ms != mo {
				t.Fatalf("step %d: mirror %d walks %d shared, %d own", step, i, ms[0], mo[0])
			}
		}
	}
}

func deltaKeys(ds []Delta) []uint64 {
	var out []uint64
	for _, d := range ds {
		out = append(out, d.Keys...)
	}
	return out
}

// FuzzDecodeSharedSnapshot: a shared decode, first or repeated, accepts
// and yields what DecodeSnapshot does.
func FuzzDecodeSharedSnapshot(f *testing.F) {
	addSnapshotSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		want, wantErr := DecodeSnapshot(b)
		sh := NewShare()
		for range 2 {
			got, err := sh.DecodeSharedSnapshot("s", b)
			if (err == nil) != (wantErr == nil) {
				t.Fatalf("shared decode error %v, DecodeSnapshot's %v", err, wantErr)
			}
			if err != nil {
				return
			}
			if got.Epoch != want.Epoch || got.Generation != want.Generation || got.Seq != want.Seq || got.M != want.M ||
				got.K != want.K || got.Keys != want.Keys || !slices.Equal(got.Words, want.Words) {
				t.Fatal("shared decode differs from DecodeSnapshot's")
			}
			var m Mirror
			if err := m.ApplySnapshot(got); err != nil {
				t.Fatalf("mirror refused a decoded snapshot: %v", err)
			}
			m.Filter().Test(42)
		}
	})
}

// FuzzDecodeSharedDelta: a shared decode, first or repeated, accepts and
// yields what DecodeDelta does; another payload is decoded afresh.
func FuzzDecodeSharedDelta(f *testing.F) {
	addDeltaSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		want, wantErr := DecodeDelta(b)
		sh := NewShare()
		other := (&Delta{Epoch: 9, Seq: 1, Keys: []uint64{7}}).AppendBinary(nil)
		for i, p := range [][]byte{b, b, other, b} {
			got, err := sh.DecodeSharedDelta("s", p)
			if i == 2 {
				if err != nil || got.Epoch != 9 || !slices.Equal(got.Keys, []uint64{7}) {
					t.Fatalf("another payload decoded as %+v, %v", got, err)
				}
				continue
			}
			if (err == nil) != (wantErr == nil) {
				t.Fatalf("shared decode error %v, DecodeDelta's %v", err, wantErr)
			}
			if err == nil && (got.Epoch != want.Epoch || got.Generation != want.Generation || got.Seq != want.Seq || !slices.Equal(got.Keys, want.Keys)) {
				t.Fatalf("shared decode %+v, DecodeDelta's %+v", got, want)
			}
		}
	})
}
