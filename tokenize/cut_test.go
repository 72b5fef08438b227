package tokenize

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

// TestWordCutSafe: every golden tokenizer can be cut at a word end, and
// one whose pre-tokenizer is not known cannot.
func TestWordCutSafe(t *testing.T) {
	for _, model := range goldenModels {
		tok, _ := goldenTokenizer(t, model)
		if !tok.wordCut {
			t.Errorf("%s: not cut at word ends", model)
		}
	}
	unknown, err := Load([]byte(`{"pre_tokenizer":{"type":"Split","pattern":{"Regex":"\\w+ ?"},"behavior":"Isolated"},
		"model":{"type":"BPE","vocab":{"a":0," ":1},"merges":[]}}`))
	if err != nil {
		t.Fatal(err)
	}
	if unknown.wordCut {
		t.Error("an unknown split pattern is cut at word ends")
	}
}

// cutTexts are texts to cut: the golden ones and a long one with every
// kind of run.
func cutTexts(t testing.TB, g *goldenFile) []string {
	texts := []string{prose(t)[:60000]}
	for _, c := range g.Encode {
		texts = append(texts, c.Text)
	}
	return texts
}

// TestWordCutIsPrefix: the ids of a text cut at any word end are the
// leading ids of the whole text.
func TestWordCutIsPrefix(t *testing.T) {
	for _, model := range goldenModels {
		tok, g := goldenTokenizer(t, model)
		for _, text := range cutTexts(t, g) {
			for _, special := range []bool{false, true} {
				full, err := tok.Encode(text, special)
				if err != nil {
					t.Fatal(err)
				}
				if special {
					full = full[:len(full)-len(tok.postAfter)]
				}
				for limit := len(text) - 1; limit > 1; limit = limit * 7 / 8 {
					p := wordEnd(text, limit)
					if p == 0 {
						continue
					}
					ids, err := tok.encodeCut(nil, text[:p], special)
					if err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(ids, full[:min(len(ids), len(full))]) || len(ids) > len(full) {
						t.Fatalf("%s: %q cut at %d: %v, whole starts %v", model, text[:min(p, 80)], p, ids, full[:min(len(ids), len(full))])
					}
				}
			}
		}
	}
}

// TestEncodePrefixExact: EncodePrefix gives the whole encode's leading ids
// whatever window it cut, and counts long prompts roughly.
func TestEncodePrefixExact(t *testing.T) {
	models := map[string]Model{"builtin": Builtin{}}
	for _, name := range goldenModels {
		models[name], _ = goldenTokenizer(t, name)
	}
	long := strings.Repeat(prose(t), 4)
	for name, tok := range models {
		for _, n := range []int{1, 7, 100, 2000} {
			for _, text := range []string{long, "one two three four five six seven eight nine ten eleven"} {
				full, err := tok.Encode(text, true)
				if err != nil {
					t.Fatal(err)
				}
				got, err := EncodePrefix(tok, text, true, Bounds{MaxTokens: n, MaxBytes: 1 << 20})
				if err != nil {
					t.Fatal(err)
				}
				if want := full[:min(n, len(full))]; !slices.Equal(got.IDs, want) {
					t.Fatalf("%s n=%d: %v, want %v", name, n, got.IDs[:min(len(got.IDs), 20)], want[:min(len(want), 20)])
				}
				if got.Estimated != (len(text) > n*windowBytesPerToken) || got.Total < len(got.IDs) {
					t.Errorf("%s n=%d: total %d (estimated %v), whole %d", name, n, got.Total, got.Estimated, len(full))
				}
				// The count is extrapolated from a window of 8 bytes a
				// token: the larger it is, the closer.
				if d := float64(got.Total-len(full)) / float64(len(full)); n >= 2000 && (d < -0.25 || d > 0.25) {
					t.Errorf("%s n=%d: total %d (estimated %v), whole %d", name, n, got.Total, got.Estimated, len(full))
				}
			}
		}
	}
}

// cutChats are chats to render in part: one long message, many short ones
// (some with escapes, one with its role after its content), a tool round
// trip.
func cutChats(t testing.TB) []Chat {
	text := prose(t)
	var many []string
	for i := 0; len(many) < 400; i += 97 {
		role := []string{"user", "assistant"}[len(many)%2]
		many = append(many, `{"role":"`+role+`","content":`+quote(t, text[i:i+180+len(many)%50])+`}`)
	}
	many[7] = `{"content":` + quote(t, "Role last: "+text[:300]) + `,"role":"user"}`
	many[9] = `{"role":"user","content":"tab\there, quote \" and \u00e9t\u00e9 then words go on and on"}`
	return []Chat{
		{Messages: []byte(`[{"role":"user","content":` + quote(t, text[:200000]) + `}]`), AddGenerationPrompt: true},
		{Messages: []byte(`[{"role":"system","content":` + quote(t, text[:30000]) + `},` + strings.Join(many, ",") + `]`), AddGenerationPrompt: true},
		{Messages: []byte(`[` + strings.Join(many, ",") + `]`)},
		{Messages: []byte(`[{"role":"user","content":"What is the weather?"},` +
			`{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"weather","arguments":"{\"city\":\"Paris\"}"}}]},` +
			`{"role":"tool","tool_call_id":"c1","content":` + quote(t, text[:40000]) + `},` +
			`{"role":"tool","tool_call_id":"c2","content":"sunny"},` + strings.Join(many[:50], ",") + `]`),
			Tools: []byte(`[{"type":"function","function":{"name":"weather","description":"Weather in a city","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]`)},
	}
}

func quote(t testing.TB, s string) string {
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestEncodeChatPrefixExact: rendering only the leading messages of a chat
// gives the whole chat's leading ids, for templates known to render in
// order and for Builtin; others render whole.
func TestEncodeChatPrefixExact(t *testing.T) {
	models := map[string]Model{"builtin": Builtin{}}
	for _, name := range []string{"llama3", "qwen2.5"} {
		tok, _ := goldenTokenizer(t, name)
		if !tok.rendersInOrder() {
			t.Fatalf("%s: template not known to render in order", name)
		}
		models[name] = tok
	}
	for name, tok := range models {
		for ci, chat := range cutChats(t) {
			_, full, err := tok.EncodeChat(chat)
			if err != nil {
				t.Fatalf("%s chat %d: %v", name, ci, err)
			}
			for _, n := range []int{1, 30, 1000, 4000} {
				got, err := EncodeChatPrefix(tok, chat, Bounds{MaxTokens: n})
				if err != nil {
					t.Fatalf("%s chat %d n=%d: %v", name, ci, n, err)
				}
				if want := full[:min(n, len(full))]; !slices.Equal(got.IDs, want) {
					i := 0
					for i < len(got.IDs) && i < len(want) && got.IDs[i] == want[i] {
						i++
					}
					t.Fatalf("%s chat %d n=%d: %d ids, want %d; first difference at %d", name, ci, n, len(got.IDs), len(want), i)
				}
				if got.Estimated != (len(chat.Messages)+len(chat.Tools) > n*windowBytesPerToken) || got.Total < len(got.IDs) {
					t.Errorf("%s chat %d n=%d: total %d (estimated %v), whole %d", name, ci, n, got.Total, got.Estimated, len(full))
				}
			}
		}
	}
}

// FuzzWordCut: for every golden tokenizer and Builtin, the ids of a text
// cut at a word end are the leading ids of the whole text.
func FuzzWordCut(f *testing.F) {
	models := map[string]wordCutter{"builtin": Builtin{}}
	for _, name := range goldenModels {
		models[name], _ = goldenTokenizer(f, name)
	}
	for _, s := range []string{"hello world again", "it's 1234 cats\n and dogs ", "é\u0301 x y", "<|im_start|>user hi there<|im_end|> x",
		"<|begin_of_text|>a b<|eot_id|>c d", "  lots   of    space  here ", "ǅ ﬁne İstanbul Ⅻ ２ x", "a\u00a0b c\td\re f"} {
		f.Add(s, uint16(len(s)/2))
	}
	f.Fuzz(func(t *testing.T, text string, limit uint16) {
		p := wordEnd(text, int(limit))
		if p == 0 {
			return
		}
		for name, m := range models {
			full, err := m.(Model).Encode(text, true)
			if err != nil {
				return // not UTF-8
			}
			cut, err := m.encodeCut(nil, text[:p], true)
			if err != nil || len(cut) > len(full) || !slices.Equal(cut, full[:len(cut)]) {
				t.Fatalf("%s: %q cut at %d: %v, %v; whole %v", name, text, p, cut, err, full)
			}
		}
	})
}

// TestPrefixReadsNoFurther: nothing past max_prefix_bytes is read, the
// invalid bytes there included; what must be read whole past it (a chat
// whose template is not known to render in order, a text without a word
// end) is refused with ErrPromptTooLong.
func TestPrefixReadsNoFurther(t *testing.T) {
	b := Bounds{MaxTokens: 1000, MaxBytes: 64 << 10}
	words := strings.Repeat("many words in a row ", 8<<10) // 160 KiB
	llama3, _ := goldenTokenizer(t, "llama3")
	jinja, _ := goldenVariant(t, "llama3", "jinja", WithChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"))
	for name, tok := range map[string]Model{"builtin": Builtin{}, "llama3": llama3} {
		if got, err := EncodePrefix(tok, words+"\xff", false, b); err != nil || len(got.IDs) != b.MaxTokens {
			t.Errorf("%s: text: %d ids, %v", name, len(got.IDs), err)
		}
		chat := Chat{Messages: []byte(`[{"role":"user","content":"` + words + `\x`)}
		if got, err := EncodeChatPrefix(tok, chat, b); err != nil || len(got.IDs) != b.MaxTokens {
			t.Errorf("%s: chat: %d ids, %v", name, len(got.IDs), err)
		}
		if _, err := EncodePrefix(tok, strings.Repeat("x", 128<<10), false, b); err != ErrPromptTooLong {
			t.Errorf("%s: a text with no word end: %v", name, err)
		}
	}
	if _, err := EncodeChatPrefix(jinja, Chat{Messages: []byte(`[{"role":"user","content":"` + words + `"}]`)}, b); err != ErrPromptTooLong {
		t.Errorf("a template not known to render in order: %v", err)
	}
}
