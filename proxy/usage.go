package proxy

import (
	"bytes"
	"encoding/json"
)

// Usage is the part of an engine's usage report the router counts:
// prompt and cached tokens, -1 when the report gave none, and completion
// tokens, 0 when it gave none (an answer has one token at least).
type Usage struct {
	Prompt, Cached, Completion int
}

// noUsage is a report that says nothing.
var noUsage = Usage{Prompt: -1, Cached: -1}

type usageJSON struct {
	PromptTokens        *int `json:"prompt_tokens"`
	CompletionTokens    *int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens *int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u *usageJSON) values() Usage {
	out := noUsage
	if u.PromptTokens != nil {
		out.Prompt = *u.PromptTokens
	}
	if u.PromptTokensDetails != nil && u.PromptTokensDetails.CachedTokens != nil {
		out.Cached = *u.PromptTokensDetails.CachedTokens
	}
	if u.CompletionTokens != nil && *u.CompletionTokens > 0 {
		out.Completion = *u.CompletionTokens
	}
	return out
}

// usageFromBody reads usage from a non-streamed completion without decoding
// the whole body: engines put usage last, so it finds the last "usage" key
// and reads its numbers from that object: -1 for a prompt or cached count
// that is absent, 0 for an absent completion count.
func usageFromBody(body []byte) Usage {
	none := noUsage
	i := bytes.LastIndex(body, usageKey)
	if i < 0 {
		return none
	}
	rest := trimSpace(body[i+len(usageKey):])
	if len(rest) == 0 || rest[0] != ':' {
		return none
	}
	rest = trimSpace(rest[1:])
	end := objectEnd(rest)
	if end < 0 {
		return none
	}
	obj := rest[:end]
	return Usage{Prompt: intField(obj, promptTokensKey), Cached: intField(obj, cachedTokensKey),
		Completion: max(intField(obj, completionTokensKey), 0)}
}

var (
	promptTokensKey     = []byte(`"prompt_tokens"`)
	cachedTokensKey     = []byte(`"cached_tokens"`)
	completionTokensKey = []byte(`"completion_tokens"`)
)

// objectEnd returns the length of the JSON object b starts with, or -1.
func objectEnd(b []byte) int {
	if len(b) == 0 || b[0] != '{' {
		return -1
	}
	depth, inString := 0, false
	for i := 0; i < len(b); i++ {
		c := b[i]
		if inString {
			switch c {
			case '\\':
				i++
			case '"':
				inString = false
			}
			continue
		}
		switch c {
		case '"':
			inString = true
		case '{', '[':
			depth++
		case '}', ']':
			depth--
			if depth == 0 {
				return i + 1
			}
		}
	}
	return -1
}

// intField returns the non-negative integer value of key in obj, -1 when
// absent, null or not an integer.
func intField(obj, key []byte) int {
	i := bytes.Index(obj, key)
	if i < 0 {
		return -1
	}
	rest := trimSpace(obj[i+len(key):])
	if len(rest) == 0 || rest[0] != ':' {
		return -1
	}
	rest = trimSpace(rest[1:])
	n, digits := 0, 0
	for _, c := range rest {
		if c < '0' || c > '9' || digits > 12 {
			break
		}
		n = n*10 + int(c-'0')
		digits++
	}
	if digits == 0 {
		return -1
	}
	return n
}

// parseUsageChunk decodes a stream chunk carrying usage. usageOnly is true
// for the extra chunk include_usage adds: usage set and no choices.
func parseUsageChunk(payload []byte) (u Usage, usageOnly, ok bool) {
	var chunk struct {
		Choices []json.RawMessage `json:"choices"`
		Usage   *usageJSON        `json:"usage"`
	}
	if json.Unmarshal(payload, &chunk) != nil || chunk.Usage == nil {
		return Usage{}, false, false
	}
	return chunk.Usage.values(), len(chunk.Choices) == 0, true
}

// trimSpace drops leading JSON whitespace (bytes.TrimLeft builds its cutset
// on every call).
func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\r' || b[0] == '\n') {
		b = b[1:]
	}
	return b
}
