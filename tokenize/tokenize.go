// Package tokenize turns request text into the token ids an engine will see.
//
// Routing by cached prefix only works when the router produces exactly the
// ids the engine produced: one wrong id in the first block and nothing
// matches. Model describes what the router and enginesim need: encode a
// completion prompt (special tokens as the engine adds them) and render plus
// encode a chat (special tokens only from the template, as vLLM does).
//
// Implementations:
//
//   - HF (LoadDir, Load) runs a HuggingFace tokenizer.json in pure Go, the
//     way the Rust tokenizers library does: added tokens are split out first
//     (lstrip, rstrip, single_word, normalized), then each segment goes
//     through the normalizer, the pre-tokenizer and the BPE model, and the
//     post-processor adds special tokens when asked. Chats render with the
//     model's template via package chattemplate. Anything it cannot run
//     exactly fails at load with an *UnsupportedError. Text between special
//     tokens is tokenized independently, so HF caches per segment: a growing
//     multi-turn chat only tokenizes its newest turn. The split patterns of
//     GPT-2, Llama-3 and Qwen2 run on hand-written scanners, fuzzed against
//     regexp2 running the patterns themselves; other patterns use regexp2.
//   - Engine asks an engine replica's vLLM /tokenize endpoint, for models
//     whose files the router lacks.
//   - Builtin is a tiny deterministic tokenizer for demos and tests.
//
// EncodePrefix and EncodeChatPrefix give what routing needs of a prompt,
// its first max_prefix_tokens ids exactly and its token count, rendering
// and tokenizing at most max_prefix_bytes of it: a prompt longer than a
// first window is cut at a word end, where HF (with a known pre-tokenizer)
// and Builtin give the whole prompt's leading ids, and counted beyond it at
// the window's ids per byte; a long chat whose template renders in order
// renders only its leading messages (cut.go).
//
// Known limits of HF: character classes come from Go's Unicode tables and
// regexp2's case folding (HF uses Oniguruma), so characters newer than
// either side's Unicode version, or "'ſ" under (?i), may split differently;
// models other than BPE (WordPiece, Unigram) and normalizers such as
// Precompiled are rejected at load.
package tokenize

import "encoding/json"

// Model tokenizes prompts the way one served model's engine does.
// Implementations must be safe for concurrent use.
type Model interface {
	// Encode tokenizes a completion prompt. addSpecialTokens mirrors vLLM's
	// flag of the same name (true by default for /v1/completions).
	Encode(text string, addSpecialTokens bool) ([]uint32, error)
	// EncodeChat renders a chat request with the model's chat template and
	// tokenizes the result without adding special tokens (vLLM's chat path).
	EncodeChat(chat Chat) (prompt string, ids []uint32, err error)
}

// Chat is the part of a chat-completions request that decides the prompt.
// Messages and Tools stay raw JSON so templates see keys in request order.
type Chat struct {
	Messages             json.RawMessage
	Tools                json.RawMessage // may be nil
	AddGenerationPrompt  bool
	ContinueFinalMessage bool
	// TemplateKwargs are extra template variables (chat_template_kwargs).
	TemplateKwargs json.RawMessage // may be nil
	// AddSpecialTokens adds the tokenizer's special tokens (a BOS) to the
	// rendered prompt, as vLLM does for a chat request that sets
	// add_special_tokens; it defaults to false there, since templates
	// write their own.
	AddSpecialTokens bool
	// IDs, when it has room, receives the ids (from IDs[:0]) instead of a
	// new slice: a server reusing one buffer per request then makes no
	// garbage for them. Implementations may ignore it.
	IDs []uint32
	// Prompt, when it is not nil, holds a buffer the prompt may be rendered
	// into, for callers that want the ids alone: rendering starts at
	// (*Prompt)[:0] and leaves *Prompt holding the buffer used (grown if it
	// had to be); the prompt returned then shares its memory, good until the
	// buffer is used again. Implementations may ignore it.
	Prompt *[]byte
}
