package chattemplate

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

var cutSeeds = []string{
	`[{"role":"user","content":"one two three four five six seven eight nine ten"}]`,
	`[{"role":"system","content":"Be brief and kind."},{"role":"user","content":"hi there"},{"role":"assistant","content":"hello you"},{"role":"user","content":"more words here"}]`,
	`[{"content":"role after content here","role":"user"},{"role":"user","content":"tab\there \"quoted\" \u00e9t\u00e9 and so on"}]`,
	`[{"role":"user","content":"x y"},{"role":"assistant","content":"calling now","tool_calls":[{"function":{"name":"f","arguments":{"a":1}}}]},{"role":"tool","content":"result one two"},{"role":"tool","content":"r2 r3"}]`,
	`[{"role":"user","content":""},{"role":"user","content":null},{"role":"user","content":[{"type":"text","text":"a b"}]},{"role":"user","content":"word"}]`,
	`[{"role":"user","content":"\u0041 \u00e9 b\u0020c d"}]`,
}

// FuzzCutMessages: the leading messages CutMessages keeps render, with the
// templates known to render in order, as the whole chat starts, up to the
// marker; and the cut is valid JSON within the budget.
func FuzzCutMessages(f *testing.F) {
	llama3, qwen := compileNatives(f)
	for _, tmpl := range []*Template{llama3, qwen} {
		if !tmpl.RendersInOrder() {
			f.Fatal("a native template is not known to render in order")
		}
	}
	for _, s := range cutSeeds {
		for _, budget := range []uint16{20, 45, 90, 200} {
			f.Add([]byte(s), budget, true)
		}
	}
	f.Fuzz(func(t *testing.T, messages []byte, budget uint16, genPrompt bool) {
		if !json.Valid(messages) || duplicateKeys(messages) {
			return // a key given twice past the budget is not seen (CutMessages)
		}
		cut, kept, ok := CutMessages(messages, int(budget))
		if !ok {
			return
		}
		if !json.Valid(cut) || kept > int(budget) || kept <= 0 {
			t.Fatalf("cut %q (kept %d of budget %d) of %q", cut, kept, budget, messages)
		}
		for _, tmpl := range []*Template{llama3, qwen} {
			full, err := tmpl.Render(Input{Messages: messages, AddGenerationPrompt: genPrompt, BOSToken: "<s>"})
			if err != nil {
				continue
			}
			part, err := tmpl.Render(Input{Messages: cut, BOSToken: "<s>"})
			if err != nil {
				continue // routed by load
			}
			end := strings.LastIndex(part, CutMarker)
			if end < 0 {
				continue // a message the template skips (an unknown role): routed by load
			}
			if !strings.HasPrefix(full, part[:end]) {
				t.Fatalf("%s: cut %q renders %q, not a prefix of %q", tmpl.Renderer(), cut, part[:end], full)
			}
		}
	})
}

// TestCutMessagesReadsNoFurther: a cut looks at the budget's bytes only, so
// a message's content that runs past it (even unterminated) is not read.
func TestCutMessagesReadsNoFurther(t *testing.T) {
	raw := []byte(`[{"role":"user","content":"hello big world and more` + strings.Repeat("x", 100))
	cut, kept, ok := CutMessages(raw, 45) // up to "hello big world an"
	if !ok || string(cut) != `[{"role":"user","content":"hello big world\u0000kvmesh-cut\u0000"}]` || kept != 42 {
		t.Fatalf("%s %d %v", cut, kept, ok)
	}
	if _, _, ok := CutMessages([]byte(`[{"content":"hello big world and more words","role":"user"}]`), 40); ok {
		t.Error("cut a message whose role comes after its content, inside the content")
	}
}

// duplicateKeys reports whether an object in the JSON data has a key twice.
func duplicateKeys(data []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(data))
	type frame struct {
		keys   map[string]bool
		object bool
		key    bool // the next string is a key
	}
	var stack []frame
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		top := len(stack) - 1
		if d, ok := tok.(json.Delim); ok {
			switch d {
			case '{', '[':
				if top >= 0 && stack[top].object {
					stack[top].key = true
				}
				stack = append(stack, frame{keys: map[string]bool{}, object: d == '{', key: d == '{'})
			default:
				stack = stack[:top]
			}
			continue
		}
		if top < 0 || !stack[top].object {
			continue
		}
		if f := &stack[top]; f.key {
			k := tok.(string)
			if f.keys[k] {
				return true
			}
			f.keys[k] = true
			f.key = false
		} else {
			f.key = true
		}
	}
}
