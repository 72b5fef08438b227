package chatconv

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/chattemplate"
	"github.com/kvmesh/kvmesh/tokenize"
)

// realTemplates returns chat templates of real models: those of the shared
// tokenizer goldens (../shared/tokenizers, beside the repository; whose
// renderings are held to transformers by chattemplate's tests) and Qwen3's,
// which renders reasoning, from chattemplate's testdata.
func realTemplates(t *testing.T) map[string]*chattemplate.Template {
	t.Helper()
	out := map[string]*chattemplate.Template{}
	add := func(name, src string) {
		tmpl, err := chattemplate.Compile(src)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = tmpl
	}
	src, err := os.ReadFile(filepath.Join("..", "chattemplate", "testdata", "gen", "templates", "qwen3.jinja"))
	if err != nil {
		t.Fatal(err)
	}
	add("qwen3", string(src))
	for _, model := range []string{"qwen2.5", "llama3"} {
		data, err := os.ReadFile(filepath.Join("..", "..", "shared", "tokenizers", model, "golden.json"))
		if err != nil {
			t.Logf("%s golden not found beside the repository (%v): skipped", model, err)
			continue
		}
		var g struct {
			ChatTemplates map[string]string `json:"chat_templates"`
		}
		if err := json.Unmarshal(data, &g); err != nil {
			t.Fatal(err)
		}
		add(model, g.ChatTemplates["default"])
	}
	return out
}

// TestRenderEqualsChat renders each converted request that has a chat
// equivalent (the chat-completions request a client would send for the same
// conversation) with real templates: the prompts must be equal, so a
// Responses or Messages request is routed exactly as the same chat is.
func TestRenderEqualsChat(t *testing.T) {
	templates := realTemplates(t)
	rendered := 0
	for _, prefix := range []string{"responses", "messages"} {
		for name, c := range loadCases(t, prefix) {
			if c.Chat == nil {
				continue
			}
			got, err := converter(prefix)(c.Body)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			chat := chattemplate.Input{
				Messages:             c.Chat.Messages,
				Tools:                c.Chat.Tools,
				Kwargs:               c.Chat.Kwargs,
				AddGenerationPrompt:  c.Chat.AddGenerationPrompt == nil || *c.Chat.AddGenerationPrompt,
				ContinueFinalMessage: c.Chat.ContinueFinalMessage,
			}
			for tname, tmpl := range templates {
				in := chattemplate.Input{
					Messages:             got.Messages,
					Tools:                got.Tools,
					Kwargs:               got.TemplateKwargs,
					AddGenerationPrompt:  got.AddGenerationPrompt,
					ContinueFinalMessage: got.ContinueFinalMessage,
				}
				if tname == "llama3" {
					in.BOSToken, chat.BOSToken = "<|begin_of_text|>", "<|begin_of_text|>"
				}
				want, werr := tmpl.Render(chat)
				prompt, err := tmpl.Render(in)
				if werr != nil || err != nil {
					// A template may refuse a conversation (roles that do
					// not alternate): then both must.
					t.Logf("%s/%s: both refused: %v", name, tname, err)
					if (werr == nil) != (err == nil) {
						t.Errorf("%s/%s: chat error %v, converted error %v", name, tname, werr, err)
					}
					continue
				}
				if prompt != want {
					t.Errorf("%s/%s:\n got %q\nwant %q", name, tname, prompt, want)
				}
				// The prompt holds the conversation's last words: the
				// comparison is not between two empty renderings.
				var msgs []struct {
					Content json.RawMessage `json:"content"`
				}
				_ = json.Unmarshal(c.Chat.Messages, &msgs)
				var last string
				_ = json.Unmarshal(msgs[len(msgs)-1].Content, &last)
				if last != "" && !strings.Contains(prompt, last) {
					t.Errorf("%s/%s: prompt lacks %q: %q", name, tname, last, prompt)
				}
				rendered++
			}
		}
	}
	t.Logf("%d renderings compared", rendered)
	if rendered < 5 {
		t.Errorf("only %d renderings compared", rendered)
	}
}

// TestTokenizeEqualsChat tokenizes the converted agent turns with Qwen2.5's
// own tokenizer and chat template (LoadDir, as the router loads a model):
// the ids must be those of the same conversation sent as a chat completion.
func TestTokenizeEqualsChat(t *testing.T) {
	dir := filepath.Join("..", "..", "shared", "tokenizers", "qwen2.5")
	tk, err := tokenize.LoadDir(dir)
	if err != nil {
		t.Skipf("qwen2.5 tokenizer beside the repository: %v", err)
	}
	for _, c := range []struct{ prefix, name string }{{"responses", "responses_agent"}, {"messages", "messages_agent"}} {
		tc := loadCases(t, c.prefix)[c.name]
		got, err := converter(c.prefix)(tc.Body)
		if err != nil {
			t.Fatal(err)
		}
		_, ids, err := tk.EncodeChat(got.Tokenize())
		if err != nil {
			t.Fatal(err)
		}
		_, want, err := tk.EncodeChat(tokenize.Chat{Messages: tc.Chat.Messages, Tools: tc.Chat.Tools, TemplateKwargs: tc.Chat.Kwargs, AddGenerationPrompt: true})
		if err != nil {
			t.Fatal(err)
		}
		if len(ids) < 50 || !slices.Equal(ids, want) {
			t.Errorf("%s: %d ids, want the chat's %d", c.name, len(ids), len(want))
		}
	}
}
