package chatconv

import (
	"bytes"
	"encoding/json"
	"errors"
)

// The usage readers give the prompt tokens an engine counted, how many of
// them it found cached and how many it generated (output_tokens in both
// APIs), -1 for what the answer does not say, as the proxy reads a chat
// completion's usage.
//
// Responses (vLLM's ResponseUsage): input_tokens counts the whole prompt,
// input_tokens_details.cached_tokens the cached part. Messages: Anthropic's
// input_tokens counts only the uncached tokens, beside cache_read_input_tokens
// and cache_creation_input_tokens; vLLM reports so since it fills the cache
// fields (with --enable-prompt-tokens-details) and, before, put the whole
// prompt in input_tokens with no cache fields. Either way the prompt is their
// sum.

// responsesUsage is vLLM's ResponseUsage, the part read.
type responsesUsage struct {
	InputTokens        *int `json:"input_tokens"`
	OutputTokens       *int `json:"output_tokens"`
	InputTokensDetails *struct {
		CachedTokens *int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
}

// Usage is what an answer's usage reports; -1 for what it does not say.
type Usage struct {
	Prompt, Cached, Output int
}

var noUsage = Usage{-1, -1, -1}

func (u *responsesUsage) values() Usage {
	if u == nil {
		return noUsage
	}
	out := Usage{Prompt: count(u.InputTokens), Cached: -1, Output: count(u.OutputTokens)}
	if u.InputTokensDetails != nil {
		out.Cached = count(u.InputTokensDetails.CachedTokens)
	}
	return out
}

// count is a reported count, -1 when absent or negative.
func count(n *int) int {
	if n == nil || *n < 0 {
		return -1
	}
	return *n
}

// messagesUsage is AnthropicUsage.
type messagesUsage struct {
	InputTokens              *int `json:"input_tokens"`
	OutputTokens             *int `json:"output_tokens"`
	CacheReadInputTokens     *int `json:"cache_read_input_tokens"`
	CacheCreationInputTokens *int `json:"cache_creation_input_tokens"`
}

func (u *messagesUsage) values() Usage {
	if u == nil {
		return noUsage
	}
	out := Usage{Prompt: count(u.InputTokens), Cached: count(u.CacheReadInputTokens), Output: count(u.OutputTokens)}
	if out.Prompt >= 0 {
		out.Prompt += max(out.Cached, 0) + max(count(u.CacheCreationInputTokens), 0)
	}
	return out
}

var usageKey = []byte(`"usage"`)

// usageReport is a usage object of either API.
type usageReport interface{ values() Usage }

// bodyUsage decodes the top-level usage of an answer into u.
func bodyUsage(body []byte, u usageReport) Usage {
	answer := struct {
		Usage usageReport `json:"usage"`
	}{u}
	if !bytes.Contains(body, usageKey) || json.Unmarshal(body, &answer) != nil {
		return noUsage
	}
	return u.values()
}

// ResponsesUsage reads the usage of a non-streamed /v1/responses answer.
func ResponsesUsage(body []byte) Usage {
	return bodyUsage(body, &responsesUsage{})
}

// ResponsesEventUsage reads the usage of a /v1/responses stream event, given
// its data payload: the response.completed event (or response.incomplete,
// its ending when max_output_tokens cut the answer) carries the response
// with its usage. ok is false for other events.
func ResponsesEventUsage(payload []byte) (Usage, bool) {
	if !bytes.Contains(payload, usageKey) {
		return noUsage, false
	}
	var ev struct {
		Type     string `json:"type"`
		Response *struct {
			Usage *responsesUsage `json:"usage"`
		} `json:"response"`
	}
	if json.Unmarshal(payload, &ev) != nil || ev.Response == nil || ev.Response.Usage == nil ||
		(ev.Type != "response.completed" && ev.Type != "response.incomplete") {
		return noUsage, false
	}
	return ev.Response.Usage.values(), true
}

// MessagesUsage reads the usage of a non-streamed /v1/messages answer.
func MessagesUsage(body []byte) Usage {
	return bodyUsage(body, &messagesUsage{})
}

// MessagesEventUsage reads the usage of a /v1/messages stream event, given
// its data payload: message_start carries it in its message, message_delta
// (the last, with the final counts) at its top. ok is false for other events.
func MessagesEventUsage(payload []byte) (Usage, bool) {
	if !bytes.Contains(payload, usageKey) {
		return noUsage, false
	}
	var ev struct {
		Type    string         `json:"type"`
		Usage   *messagesUsage `json:"usage"`
		Message *struct {
			Usage *messagesUsage `json:"usage"`
		} `json:"message"`
	}
	if json.Unmarshal(payload, &ev) != nil {
		return noUsage, false
	}
	var u *messagesUsage
	switch {
	case ev.Type == "message_delta":
		u = ev.Usage
	case ev.Type == "message_start" && ev.Message != nil:
		u = ev.Message.Usage
	}
	if u == nil {
		return noUsage, false
	}
	return u.values(), true
}

// StoredOutputs returns the text parts of the output messages of a stored
// Responses answer (the body of GET /v1/responses/{id}), in order: vLLM
// continues a stored response with one assistant message for each
// (construct_input_messages), leaving its reasoning and function calls out.
func StoredOutputs(body []byte) ([]string, error) {
	var r struct {
		Output []struct {
			Type    string `json:"type"`
			Content []struct {
				Text *string `json:"text"`
			} `json:"content"`
		} `json:"output"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, err
	}
	var texts []string
	for _, item := range r.Output {
		if item.Type != "message" {
			continue
		}
		for _, c := range item.Content {
			if c.Text == nil {
				return nil, errors.New("chatconv: an output message part without text")
			}
			texts = append(texts, *c.Text)
		}
	}
	return texts, nil
}
