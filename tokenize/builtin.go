package tokenize

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"unicode"
	"unicode/utf8"
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
func (Builtin) Encode(text string, addSpecialTokens bool) ([]uint32, error) {
	if !utf8.ValidString(text) {
		return nil, errors.New("tokenize: prompt is not valid UTF-8")
	}
	ids := make([]uint32, 0, len(text)/4+2)
	if addSpecialTokens {
		ids = append(ids, BuiltinBOS)
	}
	return appendBuiltin(ids, text), nil
}

// EncodeChat implements Model.
func (b Builtin) EncodeChat(chat Chat) (string, []uint32, error) {
	var msgs []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(chat.Messages, &msgs); err != nil {
		return "", nil, fmt.Errorf("tokenize: messages: %w", err)
	}
	var sb strings.Builder
	for _, m := range msgs {
		text, err := contentText(m.Content)
		if err != nil {
			return "", nil, err
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
	prompt := sb.String()
	ids, err := b.Encode(prompt, false)
	return prompt, ids, err
}

// contentText flattens an OpenAI message content: a string, null, or a list
// of parts of which the text parts count.
func contentText(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if raw[0] == '"' {
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", fmt.Errorf("tokenize: content: %w", err)
		}
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("tokenize: content must be a string or a list of parts: %w", err)
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
		h := fnv.New32a()
		_, _ = h.Write([]byte(text[:n]))
		ids = append(ids, 256+h.Sum32()%(builtinVocab-256))
		text = text[n:]
	}
	return ids
}

// builtinPiece returns the byte length of the first token of text.
func builtinPiece(text string) int {
	i := 0
	r, size := utf8.DecodeRuneInString(text)
	if r == ' ' && len(text) > 1 {
		next, nsize := utf8.DecodeRuneInString(text[1:])
		if !unicode.IsSpace(next) {
			i, r, size = 1, next, nsize
		}
	}
	switch {
	case unicode.IsLetter(r) || unicode.IsDigit(r):
		i += size
		for i < len(text) {
			r, size = utf8.DecodeRuneInString(text[i:])
			if !unicode.IsLetter(r) && !unicode.IsDigit(r) {
				break
			}
			i += size
		}
	case unicode.IsSpace(r):
		i += size
		for i < len(text) {
			r, size = utf8.DecodeRuneInString(text[i:])
			if !unicode.IsSpace(r) {
				break
			}
			i += size
		}
	default:
		i += size
	}
	return i
}
