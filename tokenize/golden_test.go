package tokenize

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
)

// goldenModels are the folders of ../shared/tokenizers.
var goldenModels = []string{"gpt2", "qwen2.5", "llama3", "llama2", "llama2-auto"}

// sharedTokenizers finds ../shared/tokenizers beside the repository root.
func sharedTokenizers(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Skip("go.mod not found above the test directory; cannot locate ../shared/tokenizers")
		}
		dir = parent
	}
	path := filepath.Join(dir, "..", "shared", "tokenizers")
	if _, err := os.Stat(path); err != nil {
		t.Skipf("golden tokenizer data not found at %s (expected ../shared/tokenizers beside the repo): %v", path, err)
	}
	return path
}

type goldenChat struct {
	ID                  string          `json:"id"`
	Template            string          `json:"template"`
	Messages            json.RawMessage `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	AddGenerationPrompt bool            `json:"add_generation_prompt"`
	Prompt              *string         `json:"prompt"`
	IDs                 []uint32        `json:"ids"`
	Error               *string         `json:"error"`
}

type goldenFile struct {
	ChatTemplates map[string]string `json:"chat_templates"`
	Encode        []struct {
		ID               string   `json:"id"`
		Text             string   `json:"text"`
		AddSpecialTokens bool     `json:"add_special_tokens"`
		IDs              []uint32 `json:"ids"`
	} `json:"encode"`
	Chat      []goldenChat `json:"chat"`
	ChatExtra []goldenChat `json:"chat_extra"`
}

var (
	goldenMu    sync.Mutex
	goldenCache = map[string]*HF{}
)

// goldenTokenizer loads (once per test binary) a model directory.
func goldenTokenizer(t testing.TB, model string) (*HF, *goldenFile) {
	return goldenVariant(t, model, "")
}

// goldenVariant loads a model directory with options, cached under
// model+"/"+variant.
func goldenVariant(t testing.TB, model, variant string, opts ...Option) (*HF, *goldenFile) {
	t.Helper()
	dir := filepath.Join(sharedTokenizers(t), model)
	data, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g goldenFile
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	goldenMu.Lock()
	defer goldenMu.Unlock()
	key := model + "/" + variant
	tok := goldenCache[key]
	if tok == nil {
		if tok, err = LoadDir(dir, opts...); err != nil {
			t.Fatalf("LoadDir(%s): %v", model, err)
		}
		goldenCache[key] = tok
	}
	return tok, &g
}

func TestGoldenEncode(t *testing.T) {
	for _, model := range goldenModels {
		t.Run(model, func(t *testing.T) {
			tok, g := goldenTokenizer(t, model)
			pass := 0
			for _, c := range g.Encode {
				got, err := tok.Encode(c.Text, c.AddSpecialTokens)
				if err != nil {
					t.Errorf("%s (special=%v): %v", c.ID, c.AddSpecialTokens, err)
					continue
				}
				if !slices.Equal(got, c.IDs) {
					t.Errorf("%s (special=%v) %q:\n got  %v\n want %v", c.ID, c.AddSpecialTokens, c.Text, got, c.IDs)
					continue
				}
				pass++
			}
			t.Logf("%s: encode %d/%d", model, pass, len(g.Encode))
		})
	}
}

// TestGoldenChatPromptIDs tokenizes each golden chat prompt (no template
// involved) and compares the ids.
func TestGoldenChatPromptIDs(t *testing.T) {
	for _, model := range goldenModels {
		t.Run(model, func(t *testing.T) {
			tok, g := goldenTokenizer(t, model)
			pass, total := 0, 0
			for _, c := range append(slices.Clone(g.Chat), g.ChatExtra...) {
				if c.Prompt == nil {
					continue
				}
				total++
				got, err := tok.Encode(*c.Prompt, false)
				if err != nil || !slices.Equal(got, c.IDs) {
					t.Errorf("%s/%s: err %v\n got  %v\n want %v", c.Template, c.ID, err, got, c.IDs)
					continue
				}
				pass++
			}
			t.Logf("%s: chat prompt ids %d/%d", model, pass, total)
		})
	}
}

// TestGoldenChat renders every chat case with its template and checks the
// prompt and ids, or that the template raises. Each case runs three times:
// into a new prompt, then twice into one buffer every case reuses (Chat's
// Prompt), so that anything the tokenizer cached from a reused buffer
// without copying it would spoil a later case.
func TestGoldenChat(t *testing.T) {
	for _, model := range goldenModels {
		t.Run(model, func(t *testing.T) {
			base, g := goldenTokenizer(t, model)
			byTemplate := map[string]chatRenderer{}
			pass, total := 0, 0
			cases := append(slices.Clone(g.Chat), g.ChatExtra...)
			reused := make([]byte, 0, 1<<16)
			var passes []goldenChatCase
			for _, buf := range []*[]byte{nil, &reused, &reused} {
				for _, c := range cases {
					passes = append(passes, goldenChatCase{c, buf})
				}
			}
			for _, pc := range passes {
				c := pc.goldenChat
				total++
				tmpl := byTemplate[c.Template]
				if tmpl == nil {
					src, ok := g.ChatTemplates[c.Template]
					if !ok {
						t.Fatalf("%s: template %q missing from golden.json", c.ID, c.Template)
					}
					var err error
					if tmpl, err = compileChatTemplate(src); err != nil {
						t.Fatalf("template %s: %v", c.Template, err)
					}
					byTemplate[c.Template] = tmpl
				}
				prompt, ids, err := base.encodeChat(tmpl, Chat{
					Messages:            c.Messages,
					Tools:               c.Tools,
					AddGenerationPrompt: c.AddGenerationPrompt,
					Prompt:              pc.prompt,
				})
				if c.Error != nil {
					if err == nil {
						t.Errorf("%s/%s: rendered, want error %q", c.Template, c.ID, *c.Error)
						continue
					}
					pass++
					continue
				}
				if err != nil {
					t.Errorf("%s/%s: %v", c.Template, c.ID, err)
					continue
				}
				if prompt != *c.Prompt {
					t.Errorf("%s/%s: prompt\n got  %q\n want %q", c.Template, c.ID, prompt, *c.Prompt)
					continue
				}
				if !slices.Equal(ids, c.IDs) {
					t.Errorf("%s/%s: ids\n got  %v\n want %v", c.Template, c.ID, ids, c.IDs)
					continue
				}
				pass++
			}
			t.Logf("%s: chat %d/%d", model, pass, total)
		})
	}
}

type goldenChatCase struct {
	goldenChat
	prompt *[]byte // Chat.Prompt
}

func TestNoChatTemplate(t *testing.T) {
	tok, _ := goldenTokenizer(t, "gpt2")
	_, _, err := tok.EncodeChat(Chat{Messages: json.RawMessage(`[{"role":"user","content":"hi"}]`)})
	if err == nil {
		t.Fatal("gpt2 has no chat template, EncodeChat succeeded")
	}
	var unsupported *UnsupportedError
	if errors.As(err, &unsupported) {
		t.Fatalf("wrong error type: %v", err)
	}
}
