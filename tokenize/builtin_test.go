package tokenize

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"

	segjson "github.com/segmentio/encoding/json"
)

func TestBuiltinWordsAreTokens(t *testing.T) {
	ids, err := Builtin{}.Encode("Hello world, hi  there", true)
	if err != nil {
		t.Fatal(err)
	}
	// BOS, "Hello", " world", ",", " hi", "  ", "there"
	if len(ids) != 7 || ids[0] != BuiltinBOS {
		t.Fatalf("got %d ids %v, want BOS + 6 pieces", len(ids), ids)
	}
	again, _ := Builtin{}.Encode(" world", false)
	if again[0] != ids[2] {
		t.Fatal("the same piece got two ids")
	}
}

func TestBuiltinChatSharesPrefixAcrossTurns(t *testing.T) {
	one := `[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]`
	two := `[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":[{"type":"text","text":"more"}]}]`
	_, a, err := Builtin{}.EncodeChat(Chat{Messages: json.RawMessage(one)})
	if err != nil {
		t.Fatal(err)
	}
	p, b, err := Builtin{}.EncodeChat(Chat{Messages: json.RawMessage(two), AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("turn 2 diverges from turn 1 at token %d", i)
		}
	}
	if want := "<|system|>\nYou are terse.\n<|user|>\nhi\n<|assistant|>\nyo\n<|user|>\nmore\n<|assistant|>\n"; p != want {
		t.Fatalf("prompt %q, want %q", p, want)
	}
}

func TestBuiltinRejectsInvalidUTF8(t *testing.T) {
	if _, err := (Builtin{}).Encode("a\xffb", false); err == nil {
		t.Fatal("invalid UTF-8 accepted")
	}
}

func TestBuiltinIdsAreStable(t *testing.T) {
	// enginesim and routers of different builds must agree.
	ids, _ := Builtin{}.Encode("Hello world", false)
	if len(ids) != 2 || ids[0] != 256+0xf55c314b%(builtinVocab-256) {
		t.Fatalf("ids %v changed", ids)
	}
}

func BenchmarkBuiltinEncode4KB(b *testing.B) {
	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 92)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		_, _ = Builtin{}.Encode(text, true)
	}
}

// FuzzBuiltinChatDecode: Builtin decodes chats with segmentio's JSON
// decoder for speed; on valid UTF-8 (the router rejects anything else) it
// must read messages exactly as encoding/json does.
func FuzzBuiltinChatDecode(f *testing.F) {
	for _, s := range []string{`[{"role":"user","content":"hi \u00e9\n\"q\""}]`, `[{"role":"system","content":null},{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"}]}]`,
		`[{"role":1}]`, `[{"content":"x","content":"y"}]`, `[]`, `{}`, `[{"role":"u","content":"\ud83d\ude00 \ud800"}]`, `[{"ROLE":"user"}]`} {
		f.Add([]byte(s))
	}
	type msg struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !utf8.Valid(raw) {
			return
		}
		var a, b []msg
		errA, errB := json.Unmarshal(raw, &a), segjson.Unmarshal(raw, &b)
		if (errA == nil) != (errB == nil) {
			t.Fatalf("%q: encoding/json error %v, segmentio %v", raw, errA, errB)
		}
		if errA != nil {
			return
		}
		if len(a) != len(b) {
			t.Fatalf("%q: %d vs %d messages", raw, len(a), len(b))
		}
		for i := range a {
			if a[i].Role != b[i].Role || !bytes.Equal(a[i].Content, b[i].Content) {
				t.Fatalf("%q: message %d: %+v vs %+v", raw, i, a[i], b[i])
			}
			ta, ea := contentTextWith(json.Unmarshal, a[i].Content)
			tb, eb := contentText(b[i].Content)
			if ta != tb || (ea == nil) != (eb == nil) {
				t.Fatalf("%q: content %d: %q/%v vs %q/%v", raw, i, ta, ea, tb, eb)
			}
		}
	})
}
