package bloom

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Readers walk prefixes without locks while a writer applies deltas and
// swaps in snapshots; run with -race. A key, once its delta is applied,
// must be visible to every later read.
func TestMirrorConcurrentReadersAndWriter(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 5000, MaxDeltaKeys: 150}, 1, t0)
	mirrors := make([]Mirror, 4)
	for i := range mirrors {
		if err := mirrors[i].ApplySnapshot(g.Snapshot()); err != nil {
			t.Fatal(err)
		}
	}
	keys := randomKeys(11, 3000)
	var applied atomic.Int64 // keys[:applied] are in every mirror
	var stop atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan string, 4)
	for range 3 {
		wg.Go(func() {
			filters := make([]*Filter, len(mirrors))
			matched := make([]int, len(mirrors))
			for !stop.Load() {
				n := int(applied.Load())
				for i := range mirrors {
					filters[i] = mirrors[i].Filter()
				}
				MatchPrefix(keys[:n], filters, matched)
				for _, got := range matched {
					if got != n {
						select {
						case errs <- "a reader missed an applied key":
						default:
						}
						return
					}
				}
				runtime.Gosched()
			}
		})
	}
	for i := 0; i < len(keys); i += 50 {
		for _, k := range keys[i : i+50] {
			g.Add(k)
		}
		d, _ := g.TakeDelta()
		for m := range mirrors {
			if !mirrors[m].ApplyDelta(d) {
				t.Fatalf("delta %d refused", d.Seq)
			}
		}
		if i%1000 == 0 { // a resync in the middle of it all
			if err := mirrors[0].ApplySnapshot(g.Snapshot()); err != nil {
				t.Fatal(err)
			}
		}
		applied.Store(int64(i + 50))
	}
	time.Sleep(10 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	select {
	case e := <-errs:
		t.Fatal(e)
	default:
	}
}
