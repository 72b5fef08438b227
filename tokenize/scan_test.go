package tokenize

import (
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

var scannerPatterns = []struct {
	name string
	src  string
}{
	{"gpt2", gpt2Pattern},
	{"llama3", llama3Pattern},
	{"qwen2", qwen2Pattern},
}

// palette maps fuzz bytes to characters of every class the patterns tell
// apart, so random input exercises contractions, runs and lookahead.
var palette = []rune{
	' ', ' ', ' ', '\t', '\n', '\r', '\v', '\f', 'a', 'Z', 's', 'S', 't', 'T', 'r', 'R', 'e', 'E',
	'v', 'V', 'm', 'M', 'l', 'L', 'd', 'D', '\'', '\'', '1', '2', '9', '٣', '½', '²', '!', '.',
	'-', '"', '(', 'é', 'ß', 'ſ', 'K', 'İ', '中', 'ア', '😀', '\u0301', '\u200d', '\u00a0',
	'\u2003', '\u3000', '\u2028', '\u0085', '\u180e', '\ufeff', '\x00', '\x7f', '$', '_',
}

func paletteString(data []byte) string {
	var b strings.Builder
	for _, c := range data {
		b.WriteRune(palette[int(c)%len(palette)])
	}
	return b.String()
}

var scannerRegexps = func() map[string]pattern {
	m := map[string]pattern{}
	for _, p := range scannerPatterns {
		re, err := compileRegex(p.src)
		if err != nil {
			panic(err)
		}
		m[p.src] = regexPattern{re}
	}
	return m
}()

func checkScanners(t *testing.T, s string) {
	t.Helper()
	for _, p := range scannerPatterns {
		want, err := scannerRegexps[p.src].spans(s, nil)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := scanPattern{scannerFor(p.src)}.spans(s, nil)
		if !slices.Equal(got, want) {
			t.Fatalf("%s scanner differs from regexp2 on %q:\n got  %v\n want %v", p.name, s, pieces(s, got), pieces(s, want))
		}
	}
}

func pieces(s string, spans []span) []string {
	var out []string
	for _, sp := range spans {
		mark := ""
		if !sp.match {
			mark = "(gap)"
		}
		out = append(out, mark+s[sp.start:sp.end])
	}
	return out
}

var scannerSeeds = []string{
	"", " ", "  ", "a", "Hello world", "Hello  world  ", "I'm here, they'll go; it's OK'S 'RE 'Ve",
	"x = 12345678 + 3.14\n\n\tfoo()\r\n", "\t\tword", "  \n  \n x", "日本語のテキスト", "naïve café",
	"e\u0301", "😀👍🏽 ok", "a\u00a0b\u2003c\u3000d", "''s", "'", "'x", "trailing   ", "\n", "\r\n\r\n",
	"$100 (approx.)!!! ...\n", "٣٤٥ ½²", "x\u2028y", "<|begin_of_text|>hi",
}

func TestScannersMatchRegexpOnSeeds(t *testing.T) {
	for _, s := range scannerSeeds {
		checkScanners(t, s)
	}
}

// FuzzScannerMatchesRegexp checks each hand-written scanner against regexp2
// running the pattern itself, on random UTF-8 and on random strings drawn
// from a palette of every character class the patterns distinguish.
func FuzzScannerMatchesRegexp(f *testing.F) {
	for _, s := range scannerSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 512 {
			data = data[:512]
		}
		if utf8.Valid(data) {
			checkScanners(t, string(data))
		}
		checkScanners(t, paletteString(data))
	})
}

// TestScannersMatchRegexpOnGolden runs a regexp2-only tokenizer beside the
// default one over every golden text.
func TestScannersMatchRegexpOnGolden(t *testing.T) {
	for _, model := range []string{"gpt2", "qwen2.5", "llama3"} {
		t.Run(model, func(t *testing.T) {
			fast, g := goldenTokenizer(t, model)
			slow, _ := goldenVariant(t, model, "regexp2", func(o *options) { o.regexOnly = true })
			texts := []string{}
			for _, c := range g.Encode {
				texts = append(texts, c.Text)
			}
			for _, c := range g.Chat {
				if c.Prompt != nil {
					texts = append(texts, *c.Prompt)
				}
			}
			for _, s := range texts {
				a, err1 := fast.Encode(s, false)
				b, err2 := slow.Encode(s, false)
				if err1 != nil || err2 != nil || !slices.Equal(a, b) {
					t.Fatalf("%q: scanner %v (%v), regexp2 %v (%v)", s, a, err1, b, err2)
				}
			}
		})
	}
}

// FuzzEncodeMatchesRegexp runs the whole Qwen2.5 pipeline (added tokens,
// NFC, scanner, BPE, caches) beside a regexp2-only twin on random text, and
// checks that a prefix encode is a prefix of the full one.
func FuzzEncodeMatchesRegexp(f *testing.F) {
	for _, s := range scannerSeeds {
		f.Add([]byte(s))
	}
	f.Add([]byte("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))
	fast, _ := goldenTokenizer(f, "qwen2.5")
	slow, _ := goldenVariant(f, "qwen2.5", "regexp2", func(o *options) { o.regexOnly = true })
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1024 {
			data = data[:1024]
		}
		texts := []string{paletteString(data)}
		if utf8.Valid(data) {
			texts = append(texts, string(data))
		}
		for _, s := range texts {
			a, err1 := fast.Encode(s, true)
			b, err2 := slow.Encode(s, true)
			if err1 != nil || err2 != nil || !slices.Equal(a, b) {
				t.Fatalf("%q: fast %v (%v), regexp2 %v (%v)", s, a, err1, b, err2)
			}
			if n := len(a) / 2; n > 0 {
				if p, _ := leadingIDs(fast, n, s, true); !slices.Equal(p, a[:n]) {
					t.Fatalf("%q: prefix %v, want %v", s, p, a[:n])
				}
			}
		}
	})
}
