package chatconv

import (
	"bytes"
	"encoding/json"
	"errors"
)

// The usage readers give the prompt tokens an engine counted and how many of
// them it found cached, -1 for what the answer does not say, as the proxy
// reads a chat completion's usage.prompt_tokens_details.cached_tokens.
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
	InputTokensDetails *struct {
		CachedTokens *int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
}

func (u *responsesUsage) values() (prompt, cached int) {
	prompt, cached = -1, -1
	if u == nil {
		return
	}
	prompt = count(u.InputTokens)
	if u.InputTokensDetails != nil {
		cached = count(u.InputTokensDetails.CachedTokens)
	}
	return
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
	CacheReadInputTokens     *int `json:"cache_read_input_tokens"`
	CacheCreationInputTokens *int `json:"cache_creation_input_tokens"`
}

func (u *messagesUsage) values() (prompt, cached int) {
	prompt, cached = -1, -1
	if u == nil {
		return
	}
	cached = count(u.CacheReadInputTokens)
	if prompt = count(u.InputTokens); prompt >= 0 {
		prompt += max(cached, 0) + max(count(u.CacheCreationInputTokens), 0)
	}
	return
}

var usageKey = []byte(`"usage"`)

// usageReport is a usage object of either API.
type usageReport interface{ values() (prompt, cached int) }

// bodyUsage decodes the top-level usage of an answer into u.
func bodyUsage(body []byte, u usageReport) (prompt, cached int) {
	answer := struct {
		Usage usageReport `json:"usage"`
	}{u}
	if !bytes.Contains(body, usageKey) || json.Unmarshal(body, &answer) != nil {
		return -1, -1
	}
	return u.values()
}

// ResponsesUsage reads the usage of a non-streamed /v1/responses answer.
func ResponsesUsage(body []byte) (prompt, cached int) {
	return bodyUsage(body, &responsesUsage{})
}

// ResponsesEventUsage reads the usage of a /v1/responses stream event, given
// its data payload: the response.completed event (or response.incomplete,
// its ending when max_output_tokens cut the answer) carries the response
// with its usage. ok is false for other events.
func ResponsesEventUsage(payload []byte) (prompt, cached int, ok bool) {
	if !bytes.Contains(payload, usageKey) {
		return -1, -1, false
	}
	var ev struct {
		Type     string `json:"type"`
		Response *struct {
			Usage *responsesUsage `json:"usage"`
		} `json:"response"`
	}
	if json.Unmarshal(payload, &ev) != nil || ev.Response == nil || ev.Response.Usage == nil ||
		(ev.Type != "response.completed" && ev.Type != "response.incomplete") {
		return -1, -1, false
	}
	prompt, cached = ev.Response.Usage.values()
	return prompt, cached, true
}

// MessagesUsage reads the usage of a non-streamed /v1/messages answer.
func MessagesUsage(body []byte) (prompt, cached int) {
	return bodyUsage(body, &messagesUsage{})
}

// MessagesEventUsage reads the usage of a /v1/messages stream event, given
// its data payload: message_start carries it in its message, message_delta
// (the last, with the final counts) at its top. ok is false for other events.
func MessagesEventUsage(payload []byte) (prompt, cached int, ok bool) {
	if !bytes.Contains(payload, usageKey) {
		return -1, -1, false
	}
	var ev struct {
		Type    string         `json:"type"`
		Usage   *messagesUsage `json:"usage"`
		Message *struct {
			Usage *messagesUsage `json:"usage"`
		} `json:"message"`
	}
	if json.Unmarshal(payload, &ev) != nil {
		return -1, -1, false
	}
	var u *messagesUsage
	switch {
	case ev.Type == "message_delta":
		u = ev.Usage
	case ev.Type == "message_start" && ev.Message != nil:
		u = ev.Message.Usage
	}
	if u == nil {
		return -1, -1, false
	}
	prompt, cached = u.values()
	return prompt, cached, true
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

// outputUsage is the output count both APIs put in their usage.
type outputUsage struct {
	OutputTokens *int `json:"output_tokens"`
}

// OutputTokens reads the tokens generated that a non-streamed Responses
// or Messages answer reports (usage.output_tokens), -1 when it does not.
func OutputTokens(body []byte) int {
	var a struct {
		Usage *outputUsage `json:"usage"`
	}
	if !bytes.Contains(body, usageKey) || json.Unmarshal(body, &a) != nil || a.Usage == nil {
		return -1
	}
	return count(a.Usage.OutputTokens)
}

// EventOutputTokens reads them from a stream event's data: a Responses
// stream's ending event (its response's usage), a Messages stream's
// message_delta (the final count, at its top) or message_start (its
// message's). ok is false for an event without them.
func EventOutputTokens(payload []byte) (n int, ok bool) {
	if !bytes.Contains(payload, usageKey) {
		return -1, false
	}
	var ev struct {
		Usage    *outputUsage `json:"usage"`
		Response *struct {
			Usage *outputUsage `json:"usage"`
		} `json:"response"`
		Message *struct {
			Usage *outputUsage `json:"usage"`
		} `json:"message"`
	}
	if json.Unmarshal(payload, &ev) != nil {
		return -1, false
	}
	for _, u := range []*outputUsage{ev.Usage, responseUsage(ev.Response), messageUsage(ev.Message)} {
		if u == nil {
			continue
		}
		if n := count(u.OutputTokens); n >= 0 {
			return n, true
		}
	}
	return -1, false
}

func responseUsage(r *struct {
	Usage *outputUsage `json:"usage"`
}) *outputUsage {
	if r == nil {
		return nil
	}
	return r.Usage
}

func messageUsage(m *struct {
	Usage *outputUsage `json:"usage"`
}) *outputUsage {
	if m == nil {
		return nil
	}
	return m.Usage
}
