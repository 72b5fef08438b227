package tokenize

import (
	"fmt"
	"runtime"
	"testing"
)

func TestVocabTable(t *testing.T) {
	vocab := map[string]uint32{"": 7}
	for i := range 5000 {
		vocab[fmt.Sprintf("token-%d", i)] = uint32(i) | selfMerging*uint32(i%2)
	}
	tab := newVocabTable(vocab)
	if tab.len() != len(vocab) {
		t.Fatalf("len %d, want %d", tab.len(), len(vocab))
	}
	for tok, want := range vocab {
		if got, ok := tab.get(tok); !ok || got != want {
			t.Fatalf("get(%q) = %d, %v; want %d", tok, got, ok, want)
		}
	}
	for _, absent := range []string{"token-5000", "token-", "x", "token-12\x00"} {
		if v, ok := tab.get(absent); ok {
			t.Fatalf("get(%q) found %d", absent, v)
		}
	}
	seen := 0
	tab.all(func(tok string, v uint32) {
		if vocab[tok] != v {
			t.Fatalf("all: %q → %d, want %d", tok, v, vocab[tok])
		}
		seen++
	})
	if seen != len(vocab) {
		t.Fatalf("all visited %d, want %d", seen, len(vocab))
	}
}

// TestVocabTableClash forces two tokens into one hash slot: the second is
// kept apart and both still resolve.
func TestVocabTableClash(t *testing.T) {
	tab := newVocabTable(map[string]uint32{"alpha": 1})
	tab.clash = map[string]uint32{"beta": 2} // as if "beta" hashed like "alpha"
	if v, ok := tab.get("alpha"); !ok || v != 1 {
		t.Fatal("alpha lost")
	}
	if v, ok := tab.get("beta"); !ok || v != 2 {
		t.Fatal("a clashing token must be found in the side table")
	}
}

// BenchmarkVocabGCMark times a full GC with a 128k-token vocabulary live,
// as a map[string]uint32 (the baseline) and as a vocabTable: the mark work
// every GC cycle of a router pays for its tokenizers.
func BenchmarkVocabGCMark(b *testing.B) {
	vocab := func() map[string]uint32 {
		m := make(map[string]uint32, 128_000)
		for i := range 128_000 {
			m[fmt.Sprintf("tok%x", i*2654435761)] = uint32(i)
		}
		return m
	}
	for _, c := range []struct {
		name string
		make func() any
	}{
		{"map", func() any { return vocab() }},
		{"table", func() any { return newVocabTable(vocab()) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			held := c.make()
			runtime.GC()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				runtime.GC()
			}
			runtime.KeepAlive(held)
		})
	}
}

// all calls f for every token.
func (t *vocabTable) all(f func(tok string, v uint32)) {
	for _, s := range t.spans {
		f(t.arena[s.off:s.off+s.n], s.v)
	}
	for tok, v := range t.clash {
		f(tok, v)
	}
}

func (t *vocabTable) len() int { return len(t.spans) + len(t.clash) }
