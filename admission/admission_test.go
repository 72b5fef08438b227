package admission

import (
	"sync"
	"testing"
)

func TestSecondSightingIsAdmitted(t *testing.T) {
	d := New(1000)
	if len(d.slots) != 1024 {
		t.Fatalf("slots %d, want 1024", len(d.slots))
	}
	if d.Admit(0x1234_5678_9abc_def0) {
		t.Fatal("first sighting admitted")
	}
	if !d.Admit(0x1234_5678_9abc_def0) || !d.Admit(0x1234_5678_9abc_def0) {
		t.Fatal("second and third sightings must be admitted")
	}
	if d.Admit(0) || !d.Admit(0) {
		t.Fatal("hash 0 must behave like any other")
	}
}

func TestCollisionForgetsTheOlder(t *testing.T) {
	d := New(16)
	a, b := uint64(0x100), uint64(0x200) // same slot (low 4 bits)
	d.Admit(a)
	d.Admit(b)
	if d.Admit(a) {
		t.Fatal("a was overwritten by b: it needs one more sighting")
	}
	if !d.Admit(a) {
		t.Fatal("a offered twice in a row must be admitted")
	}
}

func TestNilAdmitsEverything(t *testing.T) {
	var d *Doorkeeper
	if !d.Admit(42) {
		t.Fatal("nil doorkeeper must admit")
	}
}

func TestConcurrentUse(t *testing.T) {
	d := New(64)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10_000 {
				d.Admit(uint64(g*10_000 + i))
			}
		}()
	}
	wg.Wait()
}

func BenchmarkAdmit(b *testing.B) {
	d := New(1 << 16)
	for i := 0; i < b.N; i++ {
		d.Admit(uint64(i) * 0x9e3779b97f4a7c15)
	}
}
