package proxy

import (
	"bytes"
	"encoding/json"
)

// usage is the part of an engine's usage report the router counts.
type usage struct {
	prompt, cached int
}

type usageJSON struct {
	PromptTokens        *int `json:"prompt_tokens"`
	PromptTokensDetails *struct {
		CachedTokens *int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u *usageJSON) values() usage {
	out := usage{prompt: -1, cached: -1}
	if u.PromptTokens != nil {
		out.prompt = *u.PromptTokens
	}
	if u.PromptTokensDetails != nil && u.PromptTokensDetails.CachedTokens != nil {
		out.cached = *u.PromptTokensDetails.CachedTokens
	}
	return out
}

// usageFromBody reads usage from a non-streamed completion. Engines put
// usage last, so the fast path decodes only from its key on; a body where
// that fails is decoded whole. Returns -1s when there is none.
func usageFromBody(body []byte) (prompt, cached int) {
	if i := bytes.LastIndex(body, usageKey); i >= 0 {
		rest := bytes.TrimLeft(body[i+len(usageKey):], " \t\r\n")
		if len(rest) > 0 && rest[0] == ':' {
			var u usageJSON
			if json.NewDecoder(bytes.NewReader(rest[1:])).Decode(&u) == nil {
				v := u.values()
				return v.prompt, v.cached
			}
		}
	}
	var whole struct {
		Usage *usageJSON `json:"usage"`
	}
	if json.Unmarshal(body, &whole) != nil || whole.Usage == nil {
		return -1, -1
	}
	v := whole.Usage.values()
	return v.prompt, v.cached
}

// parseUsageChunk decodes a stream chunk carrying usage. usageOnly is true
// for the extra chunk include_usage adds: usage set and no choices.
func parseUsageChunk(payload []byte) (u usage, usageOnly, ok bool) {
	var chunk struct {
		Choices []json.RawMessage `json:"choices"`
		Usage   *usageJSON        `json:"usage"`
	}
	if json.Unmarshal(payload, &chunk) != nil || chunk.Usage == nil {
		return usage{}, false, false
	}
	return chunk.Usage.values(), len(chunk.Choices) == 0, true
}
