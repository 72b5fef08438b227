package residentset

import (
	"math/rand/v2"
	"testing"
	"unsafe"
)

// The tables against Go maps under churn: values from a small range so
// clusters form, wrap around the end and shift back on deletion; 0 included.
func TestTablesMatchMaps(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	var hi hashIndex
	var kc keyCounts
	wantHI := map[uint64][2]uint64{}
	wantKC := map[uint64]uint32{}
	for step := range 200000 {
		v := uint64(r.IntN(3000))
		if r.IntN(3) == 0 {
			v = r.Uint64() // and some from the whole range
		}
		if r.IntN(2) == 0 {
			hi.put(v, entry(v*3, uint32(v%5+1)))
			wantHI[v] = [2]uint64{v * 3, v%5 + 1}
			if added := kc.inc(v); added != (wantKC[v] == 0) {
				t.Fatalf("step %d: inc(%d) added=%v with count %d", step, v, added, wantKC[v])
			}
			wantKC[v]++
		} else {
			_, want := wantHI[v]
			if removed := hi.del(v); removed != want {
				t.Fatalf("step %d: del(%d) removed=%v, present %v", step, v, removed, want)
			}
			delete(wantHI, v)
			if wantKC[v] > 0 {
				if removed := kc.dec(v); removed != (wantKC[v] == 1) {
					t.Fatalf("step %d: dec(%d) removed=%v with count %d", step, v, removed, wantKC[v])
				}
				if wantKC[v]--; wantKC[v] == 0 {
					delete(wantKC, v)
				}
			}
		}
		if step%10000 == 0 || step > 199950 {
			if hi.len() != len(wantHI) || kc.len() != len(wantKC) {
				t.Fatalf("step %d: lens %d/%d, want %d/%d", step, hi.len(), kc.len(), len(wantHI), len(wantKC))
			}
			for k, w := range wantHI {
				if e, ok := hi.get(k); !ok || e.key() != w[0] || uint64(e.refs) != w[1] {
					t.Fatalf("step %d: get(%d) = %+v,%v want %v", step, k, e, ok, w)
				}
			}
			for k, c := range wantKC {
				if got := kc.count(k); got != c {
					t.Fatalf("step %d: count(%d) = %d want %d", step, k, got, c)
				}
			}
			appended := kc.appendTo([]uint64{42}) // appends after what dst holds
			if len(appended) != len(wantKC)+1 || appended[0] != 42 {
				t.Fatalf("step %d: appendTo gave %d keys, want %d after the 1 given", step, len(appended)-1, len(wantKC))
			}
			for _, k := range appended[1:] {
				if wantKC[k] == 0 {
					t.Fatalf("step %d: appendTo gives absent %d", step, k)
				}
			}
		}
	}
	if e, ok := hi.get(123456789); ok || e != (hashEntry{}) {
		t.Fatal("absent hash found")
	}
}

// A tier's slot is a key and an entry: 20 bytes, the bulk of a resident
// block's memory (TestMemoryPerResidentBlock).
func TestHashEntryIsTwelveBytes(t *testing.T) {
	if n := unsafe.Sizeof(hashEntry{}); n != 12 {
		t.Fatalf("hashEntry is %d bytes, want 12", n)
	}
	if e := entry(0xfedcba9876543210, 7); e.key() != 0xfedcba9876543210 || e.refs != 7 {
		t.Fatalf("entry round trip: %#x %d", e.key(), e.refs)
	}
}
