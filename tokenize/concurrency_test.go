package tokenize

import (
	"slices"
	"sync"
	"testing"
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
	c := newSegmentCache(8 * 1024)
	ids := make([]uint32, 100)
	for k := 0; k < 1000; k++ {
		c.put(string(rune('a'+k%26))+string(make([]byte, 100+k)), k%2 == 0, ids)
	}
	var total int64
	for i := range c.shards {
		sh := &c.shards[i]
		if sh.bytes > sh.max {
			t.Fatalf("shard %d holds %d bytes, bound %d", i, sh.bytes, sh.max)
		}
		n := 0
		for e := sh.head.next; e != &sh.head; e = e.next {
			n++
		}
		if n != len(sh.m) {
			t.Fatalf("shard %d: list has %d entries, map %d", i, n, len(sh.m))
		}
		total += sh.bytes
	}
	if total == 0 {
		t.Fatal("cache kept nothing")
	}
}

// TestGrowingChatTokenizesOnlyTheNewTurn: after turn 1 is encoded, encoding
// turns 1+2 tokenizes only the segments turn 2 adds.
func TestGrowingChatTokenizesOnlyTheNewTurn(t *testing.T) {
	tok, _ := goldenTokenizer(t, "llama3")
	turn1 := `[{"role":"system","content":"You are a helpful assistant who answers briefly."},{"role":"user","content":"What is the capital of France, and why is it famous?"}]`
	turn2 := turn1[:len(turn1)-1] + `,{"role":"assistant","content":"Paris: art, food, history and the Eiffel Tower."},{"role":"user","content":"And which river runs through that city?"}]`
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
	if _, want, _ := other.encodeChat(tok.chat, Chat{Messages: []byte(turn2), AddGenerationPrompt: true}, 0); !slices.Equal(second, want) {
		t.Fatal("cached chat ids differ from a fresh tokenizer's")
	}
}
