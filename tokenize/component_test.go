package tokenize

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// Components the five golden tokenizers do not exercise, checked against
// the behaviour documented for HF tokenizers.

func splitPieces(s string, p pattern, b behavior, invert bool) []string {
	spans, _ := p.spans(s, nil)
	var out []string
	for _, sp := range applyBehavior(spans, b, invert) {
		if sp.match && sp.start < sp.end {
			out = append(out, s[sp.start:sp.end])
		}
	}
	return out
}

// The examples of HF's SplitDelimiterBehavior documentation.
func TestSplitBehaviors(t *testing.T) {
	s := "the-final--countdown"
	dash := stringPattern{"-"}
	cases := []struct {
		b    behavior
		want []string
	}{
		{behaviorRemoved, []string{"the", "final", "countdown"}},
		{behaviorIsolated, []string{"the", "-", "final", "-", "-", "countdown"}},
		{behaviorMergedWithPrevious, []string{"the-", "final-", "-", "countdown"}},
		{behaviorMergedWithNext, []string{"the", "-final", "-", "-countdown"}},
		{behaviorContiguous, []string{"the", "-", "final", "--", "countdown"}},
	}
	for _, c := range cases {
		if got := splitPieces(s, dash, c.b, false); !slices.Equal(got, c.want) {
			t.Errorf("behavior %d: got %q, want %q", c.b, got, c.want)
		}
	}
	// invert: the dashes become the matches, so Removed drops them.
	re, _ := compileRegex(`[a-z]+`)
	if got, want := splitPieces(s, regexPattern{re}, behaviorRemoved, true), []string{"the", "final", "countdown"}; !slices.Equal(got, want) {
		t.Errorf("inverted Removed: got %q, want %q", got, want)
	}
	if got, want := splitPieces(s, regexPattern{re}, behaviorRemoved, false), []string{"-", "--"}; !slices.Equal(got, want) {
		t.Errorf("Removed: got %q, want %q", got, want)
	}
}

// charTokenizer builds a tokenizer.json whose BPE vocabulary holds every
// character of alphabet plus extra tokens, with the given components.
func charTokenizer(t *testing.T, alphabet string, extra []string, merges []string, parts map[string]string) *HF {
	t.Helper()
	vocab := map[string]int{}
	add := func(s string) {
		if _, ok := vocab[s]; !ok {
			vocab[s] = len(vocab)
		}
	}
	for _, r := range alphabet {
		add(string(r))
	}
	for _, s := range extra {
		add(s)
	}
	model := map[string]any{"type": "BPE", "vocab": vocab, "merges": merges}
	for k, v := range parts {
		if strings.HasPrefix(k, "model.") {
			var val any
			if err := json.Unmarshal([]byte(v), &val); err != nil {
				t.Fatal(err)
			}
			model[strings.TrimPrefix(k, "model.")] = val
		}
	}
	doc := map[string]any{"model": model}
	for _, k := range []string{"normalizer", "pre_tokenizer", "post_processor", "added_tokens"} {
		if v, ok := parts[k]; ok {
			doc[k] = json.RawMessage(v)
		}
	}
	data, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := Load(data)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// tokens maps ids back to vocabulary strings for readable assertions.
func tokens(tok *HF, ids []uint32) []string {
	inv := map[uint32]string{}
	tok.model.tokens.all(func(s string, v uint32) { inv[v&^selfMerging] = s })
	for _, m := range []*addedMatcher{tok.added, tok.addedNorm} {
		if m != nil {
			for _, a := range m.tokens {
				inv[a.ID] = a.Content
			}
		}
	}
	out := make([]string, len(ids))
	for k, id := range ids {
		out[k] = inv[id]
	}
	return out
}

func encodeTokens(t *testing.T, tok *HF, text string, special bool) []string {
	t.Helper()
	ids, err := tok.Encode(text, special)
	if err != nil {
		t.Fatal(err)
	}
	return tokens(tok, ids)
}

func TestMetaspaceSchemes(t *testing.T) {
	for _, c := range []struct {
		scheme, text string
		split        bool
		want         []string
	}{
		{"always", "hi  yo", true, []string{"▁hi", "▁", "▁yo"}},
		{"never", "hi yo", true, []string{"hi", "▁yo"}},
		{"first", "hi yo", false, []string{"▁hi", "▁yo"}},
		{"first", "<s>hi yo", false, []string{"<s>", "hi", "▁yo"}}, // not at offset 0: no ▁
		{"always", "<s>hi", false, []string{"<s>", "▁hi"}},
	} {
		split := "false"
		if c.split {
			split = "true"
		}
		tok := charTokenizer(t, "hiyo▁", []string{"▁hi", "▁yo", "hi", "▁y"}, []string{"h i", "▁ hi", "▁ y", "▁y o"}, map[string]string{
			"pre_tokenizer": `{"type":"Metaspace","replacement":"▁","prepend_scheme":"` + c.scheme + `","split":` + split + `}`,
			"added_tokens":  `[{"id":100,"content":"<s>","special":true}]`,
		})
		if got := encodeTokens(t, tok, c.text, false); !slices.Equal(got, c.want) {
			t.Errorf("%s split=%v %q: got %q, want %q", c.scheme, c.split, c.text, got, c.want)
		}
	}
}

func TestAddedTokenStripAndSingleWord(t *testing.T) {
	a := newAddedMatcher([]addedToken{
		{ID: 1, Content: "<mask>", Lstrip: true},
		{ID: 2, Content: "<sep>", Rstrip: true},
		{ID: 3, Content: "ab", SingleWord: true},
	})
	show := func(s string) []string {
		var out []string
		for _, sp := range a.split(s, nil) {
			p := s[sp.start:sp.end]
			if sp.tok >= 0 {
				p = "[" + p + "]"
			}
			out = append(out, p)
		}
		return out
	}
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"x  <mask> y", []string{"x", "[  <mask>]", " y"}},
		{"x <sep>  y", []string{"x ", "[<sep>  ]", "y"}},
		{"xab ab", []string{"xab ", "[ab]"}},
		{"ab,abc", []string{"[ab]", ",abc"}},
		{"<mask><mask>", []string{"[<mask>]", "[<mask>]"}},
	} {
		if got := show(c.in); !slices.Equal(got, c.want) {
			t.Errorf("%q: got %q, want %q", c.in, got, c.want)
		}
	}
}

func TestLeftmostLongestAddedTokens(t *testing.T) {
	a := newAddedMatcher([]addedToken{{ID: 1, Content: "<a>"}, {ID: 2, Content: "<a><b>"}, {ID: 3, Content: "b>"}})
	spans := a.split("x<a><b>y<a>", nil)
	var got []int32
	for _, sp := range spans {
		got = append(got, sp.tok)
	}
	if want := []int32{-1, 1, -1, 0}; !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestDigitsAndPunctuation(t *testing.T) {
	alpha := "a123b.,"
	ind := charTokenizer(t, alpha, []string{"12"}, []string{"1 2"}, map[string]string{"pre_tokenizer": `{"type":"Digits","individual_digits":true}`})
	if got, want := encodeTokens(t, ind, "a123b", false), []string{"a", "1", "2", "3", "b"}; !slices.Equal(got, want) {
		t.Errorf("individual digits: got %q, want %q", got, want)
	}
	con := charTokenizer(t, alpha, []string{"12"}, []string{"1 2"}, map[string]string{"pre_tokenizer": `{"type":"Digits","individual_digits":false}`})
	if got, want := encodeTokens(t, con, "a123b", false), []string{"a", "12", "3", "b"}; !slices.Equal(got, want) {
		t.Errorf("contiguous digits: got %q, want %q", got, want)
	}
}

func TestNormalizers(t *testing.T) {
	for _, c := range []struct {
		json, in, want string
	}{
		{`{"type":"Lowercase"}`, "HeLLo İ", "hello i\u0307"},
		{`{"type":"Strip","strip_left":true,"strip_right":false}`, "  a  ", "a  "},
		{`{"type":"NFKC"}`, "ﬁ①", "fi1"},
		{`{"type":"NFD"}`, "é", "e\u0301"},
		{`{"type":"NFC"}`, "e\u0301", "é"},
		{`{"type":"StripAccents"}`, "e\u0301", "e"},
		{`{"type":"Replace","pattern":{"Regex":" {2,}"},"content":"_"}`, "a  b   c d", "a_b_c d"},
		{`{"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},{"type":"Replace","pattern":{"String":" "},"content":"▁"}]}`, "a b", "▁a▁b"},
		{`{"type":"Prepend","prepend":"▁"}`, "", ""},
	} {
		n, err := parseNormalizer(json.RawMessage(c.json))
		if err != nil {
			t.Fatal(err)
		}
		if got, _ := n.normalize(c.in); got != c.want {
			t.Errorf("%s(%q) = %q, want %q", c.json, c.in, got, c.want)
		}
	}
}

func TestBPEUnknownsAndFallback(t *testing.T) {
	fuse := charTokenizer(t, "ab", []string{"<unk>"}, nil, map[string]string{"model.unk_token": `"<unk>"`, "model.fuse_unk": "true"})
	if got, want := encodeTokens(t, fuse, "axyb", false), []string{"a", "<unk>", "b"}; !slices.Equal(got, want) {
		t.Errorf("fuse_unk: got %q, want %q", got, want)
	}
	noFuse := charTokenizer(t, "ab", []string{"<unk>"}, nil, map[string]string{"model.unk_token": `"<unk>"`})
	if got, want := encodeTokens(t, noFuse, "axyb", false), []string{"a", "<unk>", "<unk>", "b"}; !slices.Equal(got, want) {
		t.Errorf("unk: got %q, want %q", got, want)
	}
	fb := charTokenizer(t, "ab", []string{"<0xC3>", "<0xA9>", "<unk>"}, nil, map[string]string{"model.unk_token": `"<unk>"`, "model.byte_fallback": "true"})
	if got, want := encodeTokens(t, fb, "aéxb", false), []string{"a", "<0xC3>", "<0xA9>", "<unk>", "b"}; !slices.Equal(got, want) {
		t.Errorf("byte_fallback: got %q, want %q", got, want)
	}
	none := charTokenizer(t, "ab", nil, nil, nil)
	if got, want := encodeTokens(t, none, "axb", false), []string{"a", "b"}; !slices.Equal(got, want) {
		t.Errorf("no unk: got %q, want %q (unknown characters vanish, as in HF)", got, want)
	}
}

func TestContinuingSubwordPrefix(t *testing.T) {
	tok := charTokenizer(t, "abc", []string{"##b", "##c", "a##b", "ab", "##bc"}, []string{"a ##b", "##b ##c"}, map[string]string{
		"model.continuing_subword_prefix": `"##"`,
		"pre_tokenizer":                   `{"type":"WhitespaceSplit"}`,
	})
	// "abc": a ##b ##c; rank 0 merges a+##b into "ab" (prefix dropped from the right side).
	if got, want := encodeTokens(t, tok, "abc bc", false), []string{"ab", "##c", "b", "##c"}; !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestTemplateProcessingBothSides(t *testing.T) {
	tok := charTokenizer(t, "ab", nil, nil, map[string]string{
		"added_tokens":   `[{"id":50,"content":"<s>","special":true},{"id":51,"content":"</s>","special":true}]`,
		"post_processor": `{"type":"TemplateProcessing","single":"<s> $A </s>","special_tokens":{"<s>":{"id":"<s>","ids":[50]},"</s>":{"id":"</s>","ids":[51]}}}`,
	})
	if got, want := encodeTokens(t, tok, "ab", true), []string{"<s>", "a", "b", "</s>"}; !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	if got, want := encodeTokens(t, tok, "ab", false), []string{"a", "b"}; !slices.Equal(got, want) {
		t.Errorf("without special tokens: got %q, want %q", got, want)
	}
}

func TestUnsupportedComponentsFailToLoad(t *testing.T) {
	base := `{"model":{"type":"BPE","vocab":{"a":0},"merges":[]}`
	for _, c := range []struct{ doc, component string }{
		{`{"model":{"type":"WordPiece","vocab":{"a":0}}}`, "model"},
		{`{"model":{"type":"Unigram","vocab":[["a",0]]}}`, "model"},
		{base + `,"normalizer":{"type":"BertNormalizer"}}`, "normalizer"},
		{base + `,"normalizer":{"type":"Precompiled","precompiled_charsmap":""}}`, "normalizer"},
		{base + `,"pre_tokenizer":{"type":"UnicodeScripts"}}`, "pre_tokenizer"},
		{base + `,"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"ByteLevel"},{"type":"Digits"}]}}`, "pre_tokenizer"},
		{base + `,"post_processor":{"type":"Foo"}}`, "post_processor"},
		{`{"model":{"type":"BPE","dropout":0.1,"vocab":{"a":0},"merges":[]}}`, "model"},
	} {
		_, err := Load([]byte(c.doc))
		var u *UnsupportedError
		if !errors.As(err, &u) || u.Component != c.component {
			t.Errorf("%s: got %v, want UnsupportedError for %s", c.doc, err, c.component)
		}
	}
	for _, bad := range []string{`{`, `{"model":{"type":"BPE","vocab":{"a":0},"merges":["a b"]}}`, `{"model":{"type":"BPE","vocab":{"a":0},"unk_token":"<unk>"}}`} {
		if _, err := Load([]byte(bad)); err == nil {
			t.Errorf("%s loaded", bad)
		}
	}
}

// FuzzLoad feeds arbitrary tokenizer.json documents to Load and encodes
// with whatever loads: no input may panic.
func FuzzLoad(f *testing.F) {
	f.Add([]byte(`{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]}}`), "abab")
	f.Add([]byte(`{"model":{"type":"BPE","vocab":{"a":0,"▁":1},"merges":[["▁","a"]],"byte_fallback":true},"pre_tokenizer":{"type":"Metaspace","replacement":"▁","prepend_scheme":"first","split":true}}`), "a a")
	f.Add([]byte(`{"added_tokens":[{"id":5,"content":"<s>","lstrip":true,"rstrip":true,"single_word":true}],"normalizer":{"type":"Sequence","normalizers":[{"type":"NFKC"},{"type":"Lowercase"}]},"pre_tokenizer":{"type":"Split","pattern":{"Regex":"\\s+"},"behavior":"MergedWithNext","invert":true},"post_processor":{"type":"TemplateProcessing","single":"<s> $A","special_tokens":{"<s>":{"id":"<s>","ids":[5]}}},"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}`), " <s> A a")
	f.Add([]byte(`{"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":true},"model":{"type":"BPE","vocab":{"Ġ":0,"a":1},"merges":[]}}`), "a a")
	f.Fuzz(func(t *testing.T, doc []byte, text string) {
		if len(doc) > 4096 || len(text) > 1024 {
			return
		}
		tok, err := Load(doc, WithSegmentCacheBytes(1<<16))
		if err != nil {
			return
		}
		full, err := tok.Encode(text, true)
		if err != nil {
			return
		}
		if again, _ := tok.Encode(text, true); !slices.Equal(full, again) {
			t.Fatalf("second encode differs: %v vs %v", full, again)
		}
		if n := len(full) / 2; n > 0 {
			if p, _ := leadingIDs(tok, n, text, true); !slices.Equal(p, full[:n]) {
				t.Fatalf("prefix %v, want %v", p, full[:n])
			}
		}
	})
}

// A normalized added token is matched after normalization, against its own
// normalized content.
func TestNormalizedAddedToken(t *testing.T) {
	tok := charTokenizer(t, "abcx", nil, nil, map[string]string{
		"normalizer":   `{"type":"Lowercase"}`,
		"added_tokens": `[{"id":90,"content":"ABC","normalized":true},{"id":91,"content":"X","normalized":false}]`,
	})
	if got, want := encodeTokens(t, tok, "aAbCXx", false), []string{"a", "abc", "X", "x"}; !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestLoadDirConfig(t *testing.T) {
	dir := t.TempDir()
	tj := `{"added_tokens":[{"id":50,"content":"<s>","special":true},{"id":51,"content":"</s>","special":true}],
	"post_processor":{"type":"TemplateProcessing","single":"<s> $A","special_tokens":{"<s>":{"id":"<s>","ids":[50]}}},
	"model":{"type":"BPE","vocab":{"a":0,"b":1},"merges":[]}}`
	write := func(name, data string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("tokenizer.json", tj)
	write("tokenizer_config.json", `{"bos_token":{"content":"<s>","__type":"AddedToken"},"eos_token":"</s>",
		"add_eos_token":true,"added_tokens_decoder":{"60":{"content":"<x>","special":true}},
		"chat_template":[{"name":"tool_use","template":"T"},{"name":"default","template":"{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"}]}`)
	tok, err := LoadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := encodeTokens(t, tok, "ab<x>", true), []string{"<s>", "a", "b", "<x>", "</s>"}; !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	prompt, ids, err := tok.EncodeChat(Chat{Messages: []byte(`[{"role":"user","content":"ab"}]`)})
	if err != nil || prompt != "<s>ab</s>" || !slices.Equal(ids, []uint32{50, 0, 1, 51}) {
		t.Errorf("chat: %q %v %v", prompt, ids, err)
	}
	// chat_template.jinja wins over the config.
	write("chat_template.jinja", "[{{ messages[0].content }}]")
	tok, err = LoadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if prompt, _ := tok.RenderChat(Chat{Messages: []byte(`[{"role":"user","content":"ab"}]`)}); prompt != "[ab]" {
		t.Errorf("chat_template.jinja ignored: %q", prompt)
	}
	if _, err := LoadDir(t.TempDir()); err == nil {
		t.Error("a directory without tokenizer.json loaded")
	}
}

func TestMergeTableGrows(t *testing.T) {
	m := newMergeTable(1)
	for k := uint64(0); k < 10000; k++ {
		m.set(k*7919, k)
	}
	for k := uint64(0); k < 10000; k++ {
		if v, ok := m.get(k * 7919); !ok || v != k {
			t.Fatalf("key %d: %d %v", k, v, ok)
		}
	}
	if _, ok := m.get(3); ok {
		t.Fatal("absent key found")
	}
}
