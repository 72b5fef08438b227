package chattemplate

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// nativeTemplates are the templates with a native renderer: the package's
// copies and, when ../shared/tokenizers is there, the models' own.
func nativeTemplates(t testing.TB) map[string]string {
	srcs := map[string]string{"llama3": llama3Template, "qwen2.5": qwen25Template}
	dir, err := findSharedTokenizers()
	if err != nil {
		t.Logf("only the package's copies: %v", err)
		return srcs
	}
	for _, m := range []string{"llama3", "qwen2.5"} {
		data, err := os.ReadFile(filepath.Join(dir, m, "tokenizer_config.json"))
		if err != nil {
			t.Fatal(err)
		}
		var cfg struct {
			ChatTemplate string `json:"chat_template"`
		}
		if err := json.Unmarshal(data, &cfg); err != nil {
			t.Fatal(err)
		}
		srcs[m+" (tokenizer_config.json)"] = cfg.ChatTemplate
	}
	return srcs
}

// jinjaOnly returns a copy of tmpl that always renders through jinja.
func jinjaOnly(tmpl *Template) *Template {
	c := *tmpl
	c.native = nil
	return &c
}

func TestKnownTemplatesRenderNatively(t *testing.T) {
	for name, src := range nativeTemplates(t) {
		tmpl, err := Compile(src)
		if err != nil {
			t.Fatal(err)
		}
		if tmpl.native == nil {
			t.Errorf("%s: no native renderer (fingerprint %x)", name, fingerprint(mustPreprocess(t, src)))
		}
		if want := "native " + strings.Fields(name)[0]; tmpl.Renderer() != want {
			t.Errorf("%s: Renderer() = %q, want %q", name, tmpl.Renderer(), want)
		}
		// Other spacing inside tags is the same template...
		respaced := strings.ReplaceAll(strings.ReplaceAll(src, " %}", " \t %}"), "{{ ", "{{\n ")
		if tmpl, err := Compile(respaced); err != nil || tmpl.native == nil {
			t.Errorf("%s respaced: native %v, err %v", name, tmpl != nil && tmpl.native != nil, err)
		}
		// ...but a change inside a string literal or of the code is not.
		for _, changed := range []string{
			strings.Replace(src, "<|im_start|>system", "<|im_start|> system", 1),
			strings.Replace(src, "<|eot_id|>", "<|eot_id|>\n", 1),
			strings.Replace(src, "add_generation_prompt", "not add_generation_prompt", 1),
		} {
			if changed == src {
				continue
			}
			tmpl, err := Compile(changed)
			if err != nil {
				t.Fatal(err)
			}
			if tmpl.native != nil || tmpl.Renderer() != "jinja" {
				t.Errorf("%s: a changed template still renders natively (%s)", name, tmpl.Renderer())
			}
		}
	}
}

func mustPreprocess(t testing.TB, src string) string {
	pre, _, err := preprocess(src, false)
	if err != nil {
		t.Fatal(err)
	}
	return pre
}

// TestNativeMatchesJinja renders random conversations through both paths:
// the same prompt or the same error, always; and most of them native.
func TestNativeMatchesJinja(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for name, src := range nativeTemplates(t) {
		tmpl, err := Compile(src)
		if err != nil {
			t.Fatal(err)
		}
		viaJinja := jinjaOnly(tmpl)
		native, nativeTools := 0, 0
		const n = 3000
		for i := range n {
			in := randomChat(r)
			if rendersNatively(tmpl, in) {
				native++
				if !isNull(in.Tools) || strings.Contains(string(in.Messages), `"tool"`) || strings.Contains(string(in.Messages), `"tool_calls"`) {
					nativeTools++
				}
			}
			got, gerr := tmpl.Render(in)
			want, werr := viaJinja.Render(in)
			if got != want || fmt.Sprint(gerr) != fmt.Sprint(werr) {
				t.Fatalf("%s case %d %s (generation prompt %v, continue %v, bos %q):\nnative %q, %v\njinja  %q, %v",
					name, i, in.Messages, in.AddGenerationPrompt, in.ContinueFinalMessage, in.BOSToken, got, gerr, want, werr)
			}
			// AppendRender appends the same prompt, or nothing on error.
			for _, tm := range []*Template{tmpl, viaJinja} {
				dst := append(make([]byte, 0, 8+r.IntN(2)*4096), "before|"...)
				appended, err := tm.AppendRender(dst, in)
				if fmt.Sprint(err) != fmt.Sprint(gerr) || string(appended) != "before|"+got {
					t.Fatalf("%s case %d: AppendRender %q, %v; Render %q, %v", name, i, appended, err, got, gerr)
				}
			}
		}
		if native < n/5 {
			t.Errorf("%s: only %d of %d conversations rendered natively", name, native, n)
		}
		t.Logf("%s: %d of %d rendered natively, %d of them with tools, tool calls or tool turns", name, native, n, nativeTools)
		if strings.HasPrefix(name, "qwen") && nativeTools < n/20 {
			t.Errorf("%s: only %d natively rendered conversations had tools", name, nativeTools)
		}
	}
}

// rendersNatively reports whether Render takes the native path for in.
func rendersNatively(tmpl *Template, in Input) bool {
	msgs, tools, err := tmpl.decode(in)
	if err != nil {
		return false
	}
	_, ok, _ := tmpl.renderNative(nil, in, msgs, tools)
	return ok
}

// TestGoldenPromptsRenderNatively: the prompts transformers rendered for
// Llama 3 and Qwen2.5 come out of the native renderers too, for every
// golden conversation they take, tools and tool turns included.
func TestGoldenPromptsRenderNatively(t *testing.T) {
	root := sharedTokenizers(t)
	for _, model := range []string{"llama3", "qwen2.5"} {
		data, err := os.ReadFile(filepath.Join(root, model, "golden.json"))
		if err != nil {
			t.Fatal(err)
		}
		var g goldenFile
		if err := json.Unmarshal(data, &g); err != nil {
			t.Fatal(err)
		}
		bos, eos := specialTokens(t, filepath.Join(root, model, "tokenizer_config.json"))
		tmpl, err := Compile(g.ChatTemplates["default"])
		if err != nil {
			t.Fatal(err)
		}
		native := 0
		for _, c := range g.Chat {
			in := Input{Messages: c.Messages, Tools: c.Tools, AddGenerationPrompt: c.AddGenerationPrompt, BOSToken: bos, EOSToken: eos}
			if c.Prompt == nil || !rendersNatively(tmpl, in) {
				continue
			}
			native++
			if got, err := tmpl.Render(in); err != nil || got != *c.Prompt {
				t.Errorf("%s/%s: %v %s", model, c.ID, err, diffContext(got, *c.Prompt))
			}
		}
		t.Logf("%s: %d of %d golden conversations rendered natively", model, native, len(g.Chat))
		if native == 0 {
			t.Errorf("%s: no golden conversation took the native path", model)
		}
	}
}

// randomChat is a conversation of the shapes clients send, with the
// whitespace and characters where renderers differ.
func randomChat(r *rand.Rand) Input {
	pieces := []string{"hi", " ", "\n", "\t", "\r\n", "\u00a0", "\u2028", "\x1c", "\u3000", "é", "\"q\"", "\\", "<|eot_id|>", "{{ x }}", "a b", "\x00", "\U0001F600"}
	text := func() string {
		var b strings.Builder
		for range r.IntN(6) {
			b.WriteString(pieces[r.IntN(len(pieces))])
		}
		return b.String()
	}
	roles := []string{"system", "user", "assistant", "user", "assistant", "tool", "developer"}
	var msgs []string
	for range r.IntN(6) {
		role := roles[r.IntN(len(roles))]
		c, _ := json.Marshal(text())
		content := string(c)
		switch r.IntN(12) {
		case 0:
			content = "null"
		case 1:
			content = fmt.Sprintf(`[{"type":"text","text":%s},{"type":"text","text":"b"}]`, c)
		case 2:
			content = "7"
		}
		m := fmt.Sprintf(`{"role":%q,"content":%s`, role, content)
		switch r.IntN(10) {
		case 0:
			m += `,"tool_calls":` + randomToolCalls(r, text)
		case 1:
			m += `,"name":"n"`
		case 2:
			m = fmt.Sprintf(`{"content":%s`, content)
		}
		msgs = append(msgs, m+"}")
	}
	in := Input{
		Messages:            json.RawMessage("[" + strings.Join(msgs, ",") + "]"),
		AddGenerationPrompt: r.IntN(2) == 0,
		BOSToken:            []string{"<|begin_of_text|>", "", "<s>"}[r.IntN(3)],
	}
	if !in.AddGenerationPrompt && r.IntN(4) == 0 {
		in.ContinueFinalMessage = true
	}
	switch r.IntN(10) {
	case 0, 3:
		in.Tools = randomTools(r, text)
	case 1:
		in.Kwargs = json.RawMessage(`{"bos_token":"B"}`)
	case 2:
		in.Tools = json.RawMessage(`null`)
	}
	return in
}

// randomTools is a tools array of the shapes clients send, valid or not.
func randomTools(r *rand.Rand, text func() string) json.RawMessage {
	var tools []string
	for range r.IntN(4) {
		name, _ := json.Marshal(text())
		desc, _ := json.Marshal(text())
		tool := []string{
			fmt.Sprintf(`{"type":"function","function":{"name":%s}}`, name),
			fmt.Sprintf(`{"type":"function","function":{"name":%s,"description":%s,"parameters":{"type":"object","properties":{"q":{"type":"string","description":%s},"n":{"type":"integer","minimum":1.0}},"required":["q"]}},"extra":[1,2.5,null,true]}`, name, desc, desc),
			fmt.Sprintf(`{"function":{"parameters":null,"name":%s,"description":null,"strict":true}}`, name),
			`{"type":"function","function":{"name":7}}`, // refused by vLLM
			`{"type":"retrieval"}`, // refused too
		}[r.IntN(5)]
		tools = append(tools, tool)
	}
	return json.RawMessage("[" + strings.Join(tools, ",") + "]")
}

// randomToolCalls is an assistant's tool_calls, with arguments as OpenAI
// SDKs send them (a JSON string), as a mapping, or broken.
func randomToolCalls(r *rand.Rand, text func() string) string {
	var calls []string
	for range r.IntN(3) {
		v, _ := json.Marshal(text())
		argsJSON, _ := json.Marshal(fmt.Sprintf(`{"q": %s, "n": 2, "deep": {"x": [1.5, null]}}`, v))
		args := []string{string(argsJSON), `{"q":` + string(v) + `,"n":1.0}`, `"not json"`, `""`, `null`, `[1]`, `{}`}[r.IntN(7)]
		name, _ := json.Marshal(text())
		call := []string{
			fmt.Sprintf(`{"id":"c1","type":"function","function":{"name":%s,"arguments":%s}}`, name, args),
			fmt.Sprintf(`{"function":{"arguments":%s,"name":"lookup"}}`, args),
			`{"type":"function","function":{"name":3,"arguments":"{}"}}`,
			`{"type":"function"}`,
		}[r.IntN(4)]
		calls = append(calls, call)
	}
	return "[" + strings.Join(calls, ",") + "]"
}

// FuzzNativeMatchesJinja: for any messages and tools JSON, both paths give
// the same prompt or the same error.
func FuzzNativeMatchesJinja(f *testing.F) {
	var templates []*Template
	for _, src := range []string{llama3Template, qwen25Template} {
		tmpl, err := Compile(src)
		if err != nil {
			f.Fatal(err)
		}
		templates = append(templates, tmpl)
	}
	r := rand.New(rand.NewPCG(3, 4))
	for range 30 {
		in := randomChat(r)
		f.Add([]byte(in.Messages), []byte(in.Tools), true, false, "<s>")
	}
	f.Add([]byte(`[]`), []byte(nil), false, true, "")
	var reused []byte // one buffer across inputs, as the gateway keeps one
	f.Fuzz(func(t *testing.T, messages, tools []byte, genPrompt, cont bool, bos string) {
		in := Input{Messages: messages, Tools: tools, AddGenerationPrompt: genPrompt, ContinueFinalMessage: cont, BOSToken: bos}
		for _, tmpl := range templates {
			got, gerr := tmpl.Render(in)
			want, werr := jinjaOnly(tmpl).Render(in)
			if got != want || fmt.Sprint(gerr) != fmt.Sprint(werr) {
				t.Fatalf("native %q, %v; jinja %q, %v", got, gerr, want, werr)
			}
			appended, aerr := tmpl.AppendRender([]byte("x"), in)
			if string(appended) != "x"+got || fmt.Sprint(aerr) != fmt.Sprint(gerr) {
				t.Fatalf("AppendRender %q, %v; Render %q, %v", appended, aerr, got, gerr)
			}
			into, ierr := tmpl.RenderInto(&reused, in)
			if into != got || fmt.Sprint(ierr) != fmt.Sprint(gerr) {
				t.Fatalf("RenderInto %q, %v; Render %q, %v", into, ierr, got, gerr)
			}
		}
	})
}

// TestToolTextsAreReused: a tools array seen a second time is kept in
// toolTexts' cache, whose texts later requests render with, as jinja does;
// other tools, or the same ones reordered, are other entries.
func TestToolTextsAreReused(t *testing.T) {
	tmpl, err := Compile(qwen25Template)
	if err != nil {
		t.Fatal(err)
	}
	viaJinja := jinjaOnly(tmpl)
	a := `{"type":"function","function":{"name":"a","description":"é\u2028","parameters":{"type":"object","properties":{"x":{"type":"number","default":1.0}}}}}`
	b := `{"type":"function","function":{"name":"b"}}`
	for i, tools := range []string{"[" + a + "," + b + "]", "[" + a + "," + b + "]", "[" + a + "," + b + "]", "[" + b + "," + a + "]", "[" + b + "," + a + "]", "[" + b + "]", "[" + b + "]"} {
		in := Input{Messages: json.RawMessage(`[{"role":"user","content":"hi"}]`), Tools: json.RawMessage(tools), AddGenerationPrompt: true}
		got, err := tmpl.Render(in)
		want, werr := viaJinja.Render(in)
		if err != nil || werr != nil || got != want {
			t.Fatalf("tools %s:\nnative %q, %v\njinja  %q, %v", tools, got, err, want, werr)
		}
		toolJSON.mu.RLock()
		texts, cached := toolJSON.m[tools]
		toolJSON.mu.RUnlock()
		firstSighting := i == 0 || i == 3 || i == 5
		if cached == firstSighting || (cached && len(texts) != strings.Count(tools, `"type":"function"`)) {
			t.Fatalf("request %d, tools %s: cached %v, %d texts", i, tools, cached, len(texts))
		}
	}
}
