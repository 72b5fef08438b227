package tokenize

import (
	"strings"

	"github.com/cespare/xxhash/v2"
)

// vocabTable is the frozen vocabulary: token bytes → id (with the
// selfMerging flag). It holds no pointers the garbage collector must trace
// beyond one arena string. As a map[string]uint32, Llama-3's 128k tokens
// were 128k string objects that every GC cycle marked, ≈4 ms of work on one
// core, paid by requests in flight as tail latency.
type vocabTable struct {
	byHash *mergeTable // xxhash(token) → index into spans
	spans  []tokenSpan
	arena  string            // every token, back to back
	clash  map[string]uint32 // tokens whose hash another token holds (none seen in practice)
}

type tokenSpan struct{ off, n, v uint32 }

func newVocabTable(vocab map[string]uint32) *vocabTable {
	t := &vocabTable{byHash: newMergeTable(len(vocab)), spans: make([]tokenSpan, 0, len(vocab))}
	size := 0
	for tok := range vocab {
		size += len(tok)
	}
	var arena strings.Builder
	arena.Grow(size)
	for tok, v := range vocab {
		h := xxhash.Sum64String(tok)
		if _, taken := t.byHash.get(h); taken || h == emptyKey {
			if t.clash == nil {
				t.clash = map[string]uint32{}
			}
			t.clash[tok] = v
			continue
		}
		t.byHash.set(h, uint64(len(t.spans)))
		t.spans = append(t.spans, tokenSpan{off: uint32(arena.Len()), n: uint32(len(tok)), v: v})
		arena.WriteString(tok)
	}
	t.arena = arena.String()
	return t
}

func (t *vocabTable) get(tok string) (uint32, bool) {
	if i, ok := t.byHash.get(xxhash.Sum64String(tok)); ok {
		s := t.spans[i]
		if t.arena[s.off:s.off+s.n] == tok {
			return s.v, true
		}
	}
	v, ok := t.clash[tok]
	return v, ok
}
