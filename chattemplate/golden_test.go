package chattemplate

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// sharedTokenizers finds ../shared/tokenizers relative to the repository
// root (the directory holding go.mod), or skips the test.
func sharedTokenizers(t testing.TB) string {
	t.Helper()
	path, err := findSharedTokenizers()
	if err != nil {
		t.Skip(err)
	}
	return path
}

// findSharedTokenizers locates ../shared/tokenizers beside the repository.
func findSharedTokenizers() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.mod not found above the test directory; cannot locate ../shared/tokenizers")
		}
		dir = parent
	}
	path := filepath.Join(dir, "..", "shared", "tokenizers")
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("golden tokenizer data not found at %s (expected ../shared/tokenizers beside the repo): %v", path, err)
	}
	return path, nil
}

type goldenFile struct {
	Model         string            `json:"model"`
	ChatTemplates map[string]string `json:"chat_templates"`
	Chat          []goldenChat      `json:"chat"`
	ChatExtra     []goldenChat      `json:"chat_extra"`
}

type goldenChat struct {
	ID                  string          `json:"id"`
	Template            string          `json:"template"`
	Messages            json.RawMessage `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	AddGenerationPrompt bool            `json:"add_generation_prompt"`
	Prompt              *string         `json:"prompt"`
	Error               *string         `json:"error"`
}

// specialTokens reads bos_token/eos_token from a tokenizer_config.json
// (plain strings, null, or the older {"content": ...} objects).
func specialTokens(t *testing.T, path string) (bos, eos string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]json.RawMessage
	if err := json.Unmarshal(data, &cfg); err != nil {
		t.Fatal(err)
	}
	tok := func(raw json.RawMessage) string {
		var s string
		if json.Unmarshal(raw, &s) == nil {
			return s
		}
		var obj struct {
			Content string `json:"content"`
		}
		_ = json.Unmarshal(raw, &obj)
		return obj.Content
	}
	return tok(cfg["bos_token"]), tok(cfg["eos_token"])
}

func TestGolden(t *testing.T) {
	root := sharedTokenizers(t)
	dirs, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, d := range dirs {
		goldenPath := filepath.Join(root, d.Name(), "golden.json")
		data, err := os.ReadFile(goldenPath)
		if err != nil {
			continue
		}
		var g goldenFile
		if err := json.Unmarshal(data, &g); err != nil {
			t.Fatalf("%s: %v", goldenPath, err)
		}
		bos, eos := specialTokens(t, filepath.Join(root, d.Name(), "tokenizer_config.json"))

		compiled := map[string]*Template{}
		for name, src := range g.ChatTemplates {
			tmpl, err := Compile(src)
			if err != nil {
				t.Errorf("%s/%s: compile: %v", d.Name(), name, err)
				continue
			}
			compiled[name] = tmpl
		}
		pass := map[string]int{}
		count := map[string]int{}
		cases := append(append([]goldenChat{}, g.Chat...), g.ChatExtra...)
		for _, c := range cases {
			count[c.Template]++
			total++
			tmpl := compiled[c.Template]
			if tmpl == nil {
				t.Errorf("%s/%s/%s: template missing", d.Name(), c.Template, c.ID)
				continue
			}
			got, err := tmpl.Render(Input{
				Messages:            c.Messages,
				Tools:               c.Tools,
				AddGenerationPrompt: c.AddGenerationPrompt,
				BOSToken:            bos,
				EOSToken:            eos,
			})
			switch {
			case c.Error != nil:
				var te *TemplateError
				if !errors.As(err, &te) {
					t.Errorf("%s/%s/%s: want TemplateError %q, got %q, %v", d.Name(), c.Template, c.ID, *c.Error, got, err)
					continue
				}
				if err.Error() != *c.Error {
					t.Errorf("%s/%s/%s: error %q, want %q", d.Name(), c.Template, c.ID, err.Error(), *c.Error)
					continue
				}
			case err != nil:
				t.Errorf("%s/%s/%s: %v", d.Name(), c.Template, c.ID, err)
				continue
			case c.Prompt == nil:
				t.Errorf("%s/%s/%s: golden has neither prompt nor error", d.Name(), c.Template, c.ID)
				continue
			case got != *c.Prompt:
				t.Errorf("%s/%s/%s: prompt differs: %s", d.Name(), c.Template, c.ID, diffContext(got, *c.Prompt))
				continue
			}
			pass[c.Template]++
		}
		names := make([]string, 0, len(count))
		for n := range count {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			t.Logf("%-12s %-24s %d/%d pass", d.Name(), n, pass[n], count[n])
		}
	}
	if total == 0 {
		t.Fatalf("no chat cases found under %s", root)
	}
}

// diffContext describes where got and want first differ, with some bytes
// of context, so a failure on a 3,000-byte prompt stays readable.
func diffContext(got, want string) string {
	n := min(len(got), len(want))
	i := 0
	for i < n && got[i] == want[i] {
		i++
	}
	from := max(0, i-40)
	return fmt.Sprintf("first difference at byte %d (len got %d, want %d)\n got: %q\nwant: %q",
		i, len(got), len(want), got[from:min(len(got), i+80)], want[from:min(len(want), i+80)])
}

// TestGoldenCRLFSource re-renders every golden template with its source in
// CRLF form: jinja2 folds line endings before lexing, so output is equal.
func TestGoldenCRLFSource(t *testing.T) {
	root := sharedTokenizers(t)
	matches, _ := filepath.Glob(filepath.Join(root, "*", "golden.json"))
	checked := 0
	for _, path := range matches {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var g goldenFile
		if err := json.Unmarshal(data, &g); err != nil {
			t.Fatal(err)
		}
		bos, eos := specialTokens(t, filepath.Join(filepath.Dir(path), "tokenizer_config.json"))
		for _, c := range g.Chat {
			src, ok := g.ChatTemplates[c.Template]
			if !ok || c.Prompt == nil || !strings.Contains(src, "\n") {
				continue
			}
			tmpl, err := Compile(strings.ReplaceAll(src, "\n", "\r\n") + "\r\n")
			if err != nil {
				t.Fatal(err)
			}
			got, err := tmpl.Render(Input{Messages: c.Messages, Tools: c.Tools, AddGenerationPrompt: c.AddGenerationPrompt, BOSToken: bos, EOSToken: eos})
			if err != nil {
				t.Fatalf("%s %s: %v", path, c.ID, err)
			}
			if got != *c.Prompt {
				t.Errorf("%s %s: CRLF source renders differently: %s", path, c.ID, diffContext(got, *c.Prompt))
			}
			checked++
		}
	}
	if checked == 0 {
		t.Skip("no golden template with newlines in its source")
	}
}
