package tokenize

import (
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/VictoriaMetrics/fastcache"
)

// TestConcurrentEncodesAgreeWithGolden encodes every golden case from
// several goroutines at once, three times over, so later rounds come from
// the segment and piece caches. Run with -race.
func TestConcurrentEncodesAgreeWithGolden(t *testing.T) {
	for _, model := range []string{"qwen2.5"} {
		tok, g := goldenVariant(t, model, "small-caches", WithSegmentCacheBytes(64<<10))
		var wg sync.WaitGroup
		errs := make(chan string, 8)
		for w := 0; w < 4; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				for round := 0; round < 3; round++ {
					for k := range g.Encode {
						c := g.Encode[(k+w*31)%len(g.Encode)]
						got, err := tok.Encode(c.Text, c.AddSpecialTokens)
						if err != nil || !slices.Equal(got, c.IDs) {
							select {
							case errs <- model + "/" + c.ID:
							default:
							}
							return
						}
					}
				}
			}(w)
		}
		wg.Wait()
		close(errs)
		for id := range errs {
			t.Errorf("%s: concurrent encode differs from golden", id)
		}
	}
}

func TestSegmentCacheEvictsByBytes(t *testing.T) {
	c := newSegmentCache(0) // raised to the 32 MiB minimum
	ids := make([]uint32, 100)
	var buf []byte
	text := func(k int) string { return fmt.Sprintf("segment %d %s", k, strings.Repeat("x", 1000)) }
	n := int(3 * c.maxBytes / 1400) // three times what fits
	for k := range n {
		buf = c.put(buf, text(k), k%2 == 0, ids)
	}
	var st fastcache.Stats
	c.c.UpdateStats(&st)
	if st.BytesSize > st.MaxBytesSize || st.MaxBytesSize > uint64(c.maxBytes)+64<<10*512 {
		t.Fatalf("cache holds %d bytes, bound %d (asked %d)", st.BytesSize, st.MaxBytesSize, c.maxBytes)
	}
	got, _, ok := c.appendTo(nil, nil, text(n-1), (n-1)%2 == 0)
	if !ok || len(got) != len(ids) {
		t.Fatal("the newest entry is gone")
	}
	if _, _, ok := c.appendTo(nil, nil, text(0), true); ok {
		t.Fatal("the oldest entry survived three times the cache's size")
	}
	if _, _, ok := c.appendTo(nil, nil, text(n-1), (n-1)%2 != 0); ok {
		t.Fatal("first-ness is part of the key")
	}
}

// TestSegmentCacheComparesText: an entry found under a text's key but
// holding another text (what a hash collision would look like) is a miss.
func TestSegmentCacheComparesText(t *testing.T) {
	c := newSegmentCache(0)
	k := segmentKey("hello world", false, false)
	c.c.Set(k[:], append([]byte{1, 0, 0, 0}, "hello wordl"...))
	if _, _, ok := c.appendTo(nil, nil, "hello world", false); ok {
		t.Fatal("returned the ids of another text")
	}
	c.put(nil, "hello world", false, []uint32{7, 9})
	if got, _, ok := c.appendTo([]uint32{1}, nil, "hello world", false); !ok || !slices.Equal(got, []uint32{1, 7, 9}) {
		t.Fatalf("got %v %v", got, ok)
	}
}

// TestGrowingChatTokenizesOnlyTheNewTurn: after turn 1 is encoded, encoding
// turns 1+2 tokenizes only the segments turn 2 adds.
var growingChatRuns atomic.Int32

func TestGrowingChatTokenizesOnlyTheNewTurn(t *testing.T) {
	tok, _ := goldenTokenizer(t, "llama3")
	// The tokenizer (and its caches) outlive one run of the test (-count):
	// each run's turns are its own.
	run := growingChatRuns.Add(1)
	turn1 := fmt.Sprintf(`[{"role":"system","content":"You are a helpful assistant who answers briefly."},{"role":"user","content":"What is the capital of France (run %d), and why is it famous?"}]`, run)
	turn2 := turn1[:len(turn1)-1] + fmt.Sprintf(`,{"role":"assistant","content":"Paris (run %d): art, food, history and the Eiffel Tower."},{"role":"user","content":"And which river runs through that city (run %d)?"}]`, run, run)
	_, first, err := tok.EncodeChat(Chat{Messages: []byte(turn1), AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	before := tok.segmentMisses.Load()
	_, second, err := tok.EncodeChat(Chat{Messages: []byte(turn2), AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	// New segments long enough to cache: the assistant and user contents.
	if misses := tok.segmentMisses.Load() - before; misses != 2 {
		t.Fatalf("turn 2 tokenized %d segments afresh, want 2", misses)
	}
	if !slices.Equal(second[:len(first)-4], first[:len(first)-4]) {
		t.Fatal("turn 2 does not extend turn 1")
	}
	// Another instance (regexp2 splitting, its own caches) has never seen
	// these turns.
	other, _ := goldenVariant(t, "llama3", "regexp2", func(o *options) { o.regexOnly = true })
	if _, want, _ := other.encodeChat(tok.chat, Chat{Messages: []byte(turn2), AddGenerationPrompt: true}); !slices.Equal(second, want) {
		t.Fatal("cached chat ids differ from a fresh tokenizer's")
	}
}

// TestSegmentCacheBigEntry: a segment too big for one fastcache chunk is
// stored across several and read back whole.
func TestSegmentCacheBigEntry(t *testing.T) {
	c := newSegmentCache(0)
	text := strings.Repeat("long system prompt ", 5000) // 95 KB
	ids := make([]uint32, 20000)
	for i := range ids {
		ids[i] = uint32(i * 7)
	}
	c.put(nil, text, true, ids)
	got, _, ok := c.appendTo(nil, nil, text, true)
	if !ok || !slices.Equal(got, ids) {
		t.Fatalf("big entry: ok %v, %d ids", ok, len(got))
	}
}

// TestSegmentCacheOddEntries: entries of any shape read back or miss, and
// never make fastcache read one kind of entry as another. A 16-byte text
// without ids once looked like SetBig's index and crashed GetBig (found by
// FuzzLoad: a tokenizer with an empty vocabulary).
func TestSegmentCacheOddEntries(t *testing.T) {
	c := newSegmentCache(0)
	for _, e := range []struct {
		text string
		ids  []uint32
		kept bool
	}{
		{"0000000000000000", nil, true},                                       // 16 bytes, no ids
		{strings.Repeat("ab", 8), []uint32{1}, true},                          // 20 bytes
		{strings.Repeat("x", 1000), make([]uint32, 20000), false},             // more ids than bytes, past one chunk
		{strings.Repeat("big ", minBigText/4+1), make([]uint32, 20000), true}, // big, across chunks
	} {
		c.put(nil, e.text, false, e.ids)
		got, _, ok := c.appendTo(nil, nil, e.text, false)
		if ok != e.kept || ok && len(got) != len(e.ids) {
			t.Errorf("%d bytes, %d ids: found %v with %d ids, want found %v", len(e.text), len(e.ids), ok, len(got), e.kept)
		}
	}
}

// BenchmarkSegmentCacheGCMark times a full GC with the segment cache empty
// (the baseline) and holding 60k segments (≈64 MiB, full): the entries live
// outside the Go heap, so the two should match.
func BenchmarkSegmentCacheGCMark(b *testing.B) {
	for _, fill := range []int{0, 60_000} {
		b.Run(fmt.Sprintf("entries=%d", fill), func(b *testing.B) {
			c := newSegmentCache(DefaultSegmentCacheBytes)
			defer c.reset()
			ids := make([]uint32, 120)
			var buf []byte
			for k := range fill {
				buf = c.put(buf, fmt.Sprintf("segment %d %s", k, strings.Repeat("y", 500)), false, ids)
			}
			runtime.GC()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				runtime.GC()
			}
			runtime.KeepAlive(c)
		})
	}
}

// TestSegmentCacheFreedWithTokenizer: a tokenizer that goes away returns
// its off-heap segment chunks (fastcache's free list), so loading
// tokenizers again and again does not grow the process.
func TestSegmentCacheFreedWithTokenizer(t *testing.T) {
	dir := filepath.Join(sharedTokenizers(t), "llama3")
	entries := func(c *segmentCache) uint64 {
		var st fastcache.Stats
		c.c.UpdateStats(&st)
		return st.EntriesCount
	}
	c := func() *segmentCache {
		tok, err := LoadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 2000 {
			if _, err := tok.Encode(fmt.Sprintf("segment %d %s", i, strings.Repeat("z", 200)), false); err != nil {
				t.Fatal(err)
			}
		}
		return tok.segments
	}()
	if entries(c) == 0 {
		t.Fatal("nothing cached")
	}
	deadline := time.Now().Add(5 * time.Second)
	for entries(c) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the segment cache of an unreachable tokenizer was not reset")
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
}
