package tokenize

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	segjson "github.com/segmentio/encoding/json"

	"github.com/kvmesh/kvmesh/jsonscan"
)

// Builtin is a simple deterministic tokenizer for demos and tests, shared by
// enginesim and the router so both agree without model files. A token is a
// word (letters and digits, with its leading space), a single other
// character (with its leading space), or a run of whitespace; its id is a
// hash of its text. Chats render as "<|role|>\ncontent\n" per message.
type Builtin struct{}

// Builtin ids: 0 unused, 1 BOS; text tokens hash into [256, builtinVocab).
const (
	BuiltinBOS   = 1
	builtinVocab = 1 << 17
)

// Encode implements Model.
func (b Builtin) Encode(text string, addSpecialTokens bool) ([]uint32, error) {
	return b.encodeCut(make([]uint32, 0, len(text)/4+2), text, addSpecialTokens)
}

// EncodeChat implements Model.
func (b Builtin) EncodeChat(chat Chat) (string, []uint32, error) {
	prompt, err := b.renderChat(chat)
	if err != nil {
		return "", nil, err
	}
	ids, err := b.Encode(prompt, chat.AddSpecialTokens)
	return prompt, ids, err
}

// Builtin's pieces end at a space after a letter or digit, and chats
// render message after message: both can be cut (EncodePrefix).
func (Builtin) cutsAtWords() bool    { return true }
func (Builtin) rendersInOrder() bool { return true }

func (b Builtin) encodeCut(dst []uint32, text string, addSpecialTokens bool) ([]uint32, error) {
	if !utf8.ValidString(text) {
		return nil, errors.New("tokenize: prompt is not valid UTF-8")
	}
	dst = dst[:0]
	if addSpecialTokens {
		dst = append(dst, BuiltinBOS)
	}
	return appendBuiltin(dst, text), nil
}

func (Builtin) renderChat(chat Chat) (string, error) {
	var msgs []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	// segmentio's decoder is a drop-in for encoding/json here, 5× faster on
	// chats (engine and router decode with this same function). It recurses
	// without a limit, so nesting is bounded first, as encoding/json does.
	if !jsonscan.DepthWithin(chat.Messages, jsonscan.MaxDepth) {
		return "", fmt.Errorf("tokenize: messages nest deeper than %d levels", jsonscan.MaxDepth)
	}
	if err := segjson.Unmarshal(chat.Messages, &msgs); err != nil {
		return "", fmt.Errorf("tokenize: messages: %w", err)
	}
	var sb strings.Builder
	for _, m := range msgs {
		text, err := contentText(m.Content)
		if err != nil {
			return "", err
		}
		sb.WriteString("<|")
		sb.WriteString(m.Role)
		sb.WriteString("|>\n")
		sb.WriteString(text)
		sb.WriteString("\n")
	}
	if chat.AddGenerationPrompt {
		sb.WriteString("<|assistant|>\n")
	}
	return sb.String(), nil
}

// contentText flattens an OpenAI message content: a string, null, or a list
// of parts of which the text parts count.
func contentText(raw json.RawMessage) (string, error) {
	return contentTextWith(segjson.Unmarshal, raw)
}

func contentTextWith(unmarshal func([]byte, any) error, raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if raw[0] == '"' {
		if err := unmarshal(raw, &s); err != nil {
			return "", fmt.Errorf("tokenize: content: %w", err)
		}
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := unmarshal(raw, &parts); err != nil {
		// err names Go types; the client needs the shape it should send.
		return "", errors.New(`tokenize: content must be a string or a list of parts such as {"type":"text","text":"..."}`)
	}
	var sb strings.Builder
	for _, p := range parts {
		if p.Type == "text" {
			sb.WriteString(p.Text)
		}
	}
	return sb.String(), nil
}

func appendBuiltin(ids []uint32, text string) []uint32 {
	for len(text) > 0 {
		n := builtinPiece(text)
		ids = append(ids, 256+fnv1a(text[:n])%(builtinVocab-256))
		text = text[n:]
	}
	return ids
}

// fnv1a is 32-bit FNV-1a, inline so hashing a piece does not allocate.
func fnv1a(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}

// builtinPiece returns the byte length of the first token of text.
func builtinPiece(text string) int {
	i := 0
	r, size := builtinRune(text)
	if r == ' ' && len(text) > 1 {
		next, nsize := builtinRune(text[1:])
		if !builtinSpace(next) {
			i, r, size = 1, next, nsize
		}
	}
	switch {
	case builtinWord(r):
		i += size
		for i < len(text) {
			r, size = builtinRune(text[i:])
			if !builtinWord(r) {
				break
			}
			i += size
		}
	case builtinSpace(r):
		i += size
		for i < len(text) {
			r, size = builtinRune(text[i:])
			if !builtinSpace(r) {
				break
			}
			i += size
		}
	default:
		i += size
	}
	return i
}

func builtinRune(s string) (rune, int) {
	if s[0] < utf8.RuneSelf {
		return rune(s[0]), 1
	}
	return utf8.DecodeRuneInString(s)
}

func builtinWord(r rune) bool {
	if r < utf8.RuneSelf {
		return 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9'
	}
	return unicode.IsLetter(r) || unicode.IsDigit(r)
}

func builtinSpace(r rune) bool {
	if r < utf8.RuneSelf {
		return r == ' ' || '\t' <= r && r <= '\r'
	}
	return unicode.IsSpace(r)
}
