package tokenize_test

import (
	"fmt"

	"github.com/kvmesh/kvmesh/tokenize"
)

// A SentencePiece-style BPE tokenizer.json, small enough to read: Metaspace
// turns spaces into "▁" (and prepends one at the start of the input), BPE
// merges characters by rank, and the post-processor adds <s>.
const tinyTokenizer = `{
  "added_tokens": [{"id": 0, "content": "<s>", "special": true}],
  "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
  "model": {"type": "BPE",
    "vocab": {"<s>": 0, "▁": 1, "h": 2, "i": 3, "t": 4, "e": 5, "r": 6,
              "hi": 7, "▁hi": 8, "th": 9, "er": 10, "ther": 11, "▁ther": 12},
    "merges": ["h i", "▁ hi", "t h", "e r", "th er", "▁ ther"]}
}`

func Example() {
	tok, err := tokenize.Load([]byte(tinyTokenizer))
	if err != nil {
		panic(err)
	}
	// Completions add special tokens (vLLM's default for /v1/completions).
	ids, _ := tok.Encode("hi there", true)
	fmt.Println(ids)
	// Text between special tokens is tokenized on its own.
	ids, _ = tok.Encode("<s>hi there", false)
	fmt.Println(ids)
	// Routing looks at a bounded prefix only, and counts the rest.
	p, _ := tokenize.EncodePrefix(tok, "hi there", true, tokenize.Bounds{MaxTokens: 2})
	fmt.Println(p.IDs, p.Total)
	// Output:
	// [0 8 12 5]
	// [0 7 12 5]
	// [0 8] 4
}

func ExampleLoadDir() {
	tok, err := tokenize.LoadDir("/models/Meta-Llama-3-8B-Instruct")
	if err != nil {
		fmt.Println(err)
		return
	}
	prompt, ids, err := tok.EncodeChat(tokenize.Chat{
		Messages:            []byte(`[{"role":"user","content":"What is the capital of France?"}]`),
		AddGenerationPrompt: true,
	})
	fmt.Println(prompt, len(ids), err)
}
