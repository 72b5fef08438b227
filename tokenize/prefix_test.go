package tokenize

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// leadingIDs is EncodePrefix's ids of text with a budget of n tokens.
func leadingIDs(m Model, n int, text string, addSpecialTokens bool) ([]uint32, error) {
	p, err := EncodePrefix(m, text, addSpecialTokens, Bounds{MaxTokens: n})
	return p.IDs, err
}

// TestPrefixEqualsLeadingIDs: for every golden text and several budgets the
// prefix ids are exactly the first ids of the full encode.
func TestPrefixEqualsLeadingIDs(t *testing.T) {
	for _, model := range goldenModels {
		t.Run(model, func(t *testing.T) {
			tok, g := goldenTokenizer(t, model)
			for _, c := range g.Encode {
				full, err := tok.Encode(c.Text, c.AddSpecialTokens)
				if err != nil {
					t.Fatal(err)
				}
				for _, n := range []int{1, 2, 3, 5, 8, 13, len(full) - 1, len(full), len(full) + 1} {
					if n <= 0 {
						continue
					}
					got, err := leadingIDs(tok, n, c.Text, c.AddSpecialTokens)
					if err != nil {
						t.Fatal(err)
					}
					if want := full[:min(n, len(full))]; !slices.Equal(got, want) {
						t.Fatalf("%s special=%v n=%d:\n got  %v\n want %v", c.ID, c.AddSpecialTokens, n, got, want)
					}
				}
			}
		})
	}
}

// TestPrefixStopsEarly: a 16-token budget over 8 MB of text must not cost
// anything like tokenizing 8 MB.
func TestPrefixStopsEarly(t *testing.T) {
	tok, _ := goldenTokenizer(t, "llama3")
	huge := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 8<<20/45)
	start := time.Now()
	ids, err := leadingIDs(tok, 16, huge, true)
	if err != nil {
		t.Fatal(err)
	}
	if elapsed := time.Since(start); elapsed > 500*time.Millisecond {
		t.Fatalf("16-token prefix of 8 MB took %v", elapsed)
	}
	full, _ := tok.Encode(huge[:200], true)
	if !slices.Equal(ids, full[:16]) {
		t.Fatalf("prefix %v, want %v", ids, full[:16])
	}
}

func TestPrefixOverOtherModels(t *testing.T) {
	ids, err := leadingIDs(Builtin{}, 2, "one two three four", true)
	if err != nil || len(ids) != 2 || ids[0] != BuiltinBOS {
		t.Fatalf("got %v, %v", ids, err)
	}
}

func BenchmarkPrefix16k(b *testing.B) {
	tok, _ := goldenVariant(b, "llama3", "nosegcache", WithSegmentCacheBytes(0))
	text := strings.Repeat(prose(b), 8) // ~2.8 MB, ~650k tokens
	b.ReportAllocs()
	for b.Loop() {
		ids, err := leadingIDs(tok, DefaultMaxPrefixTokens, text, true)
		if err != nil || len(ids) != DefaultMaxPrefixTokens {
			b.Fatal(len(ids), err)
		}
	}
}

// TestPathologicalInputs: long runs without break points (one huge piece
// for BPE, one huge whitespace run for the scanners) stay fast and exact.
func TestPathologicalInputs(t *testing.T) {
	for _, model := range []string{"llama3", "llama2"} {
		tok, _ := goldenTokenizer(t, model)
		for _, text := range []string{
			strings.Repeat("a", 256<<10),
			strings.Repeat(" ", 256<<10) + "x",
			strings.Repeat("\u00e9\U0001F600", 32<<10),
		} {
			start := time.Now()
			ids, err := tok.Encode(text, false)
			if err != nil || len(ids) == 0 {
				t.Fatalf("%s: %d ids, %v", model, len(ids), err)
			}
			if d := time.Since(start); d > 20*time.Second {
				t.Fatalf("%s: %d bytes took %v", model, len(text), d)
			}
			again, _ := leadingIDs(tok, 100, text, false)
			if !slices.Equal(again, ids[:min(100, len(ids))]) {
				t.Fatalf("%s: prefix differs", model)
			}
		}
	}
}

// TestSplitMetaIsExact: cutting SentencePiece-style pieces before "▁" runs
// (allowed by the Llama-2 vocabulary) gives the ids of whole-piece BPE.
func TestSplitMetaIsExact(t *testing.T) {
	for _, model := range []string{"llama2", "llama2-auto"} {
		tok, g := goldenTokenizer(t, model)
		if !tok.model.splitMeta {
			t.Fatalf("%s: splitMeta not enabled", model)
		}
		whole, _ := goldenVariant(t, model, "nocache", WithSegmentCacheBytes(0))
		whole.model.splitMeta = false
		texts := []string{prose(t)[:20000]}
		for _, c := range g.Encode {
			texts = append(texts, c.Text)
		}
		for _, s := range texts {
			a, _ := tok.Encode(s, true)
			b, _ := whole.Encode(s, true)
			if !slices.Equal(a, b) {
				t.Fatalf("%s %q: split %v, whole %v", model, s[:min(len(s), 80)], a, b)
			}
		}
	}
}
