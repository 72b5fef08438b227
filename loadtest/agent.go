package loadtest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chatconv"
	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
)

// conversation is what the client keeps of an agent conversation after a
// turn: the chat messages the engine rendered it from, the Responses items
// sent so far, and the answer.
type conversation struct {
	chat   []json.RawMessage
	items  []json.RawMessage
	id     string // the answer's response id (through the router: rewritten)
	answer string
}

// agentRequest is one turn ready to send: the Responses body, the chat
// body it amounts to, and the messages the engine renders for either.
type agentRequest struct {
	responses, chat []byte
	messages        []json.RawMessage
	items           []json.RawMessage // the conversation's items after this turn's input
	followUp        bool
}

// buildTurn lays out turn t of a conversation whose previous turn left
// prev (nil on turn 0). A stored conversation's later turns name the
// previous response and send their instructions and new input only, and
// the engine renders the instructions, its stored messages less their
// system message, the stored answer, then that input
// (construct_input_messages); as that layout is not what the whole history
// converts to (a function call after an answer joins that answer's
// message), the chat sent for the same turn follows the engine's layout,
// so both APIs render the same prompt.
func buildTurn(model string, t *workload.AgentTurn, maxTokens int, prev *conversation) (agentRequest, error) {
	var a agentRequest
	body := map[string]any{"model": model, "tools": t.Tools, "max_output_tokens": maxTokens, "stream": true, "store": t.Stored}
	switch {
	case prev == nil:
		a.items = t.Input
		body["instructions"] = t.Instructions
	case t.Stored:
		// Instructions do not carry over a previous_response_id (OpenAI's
		// spec; vLLM since 01ca842d): an agent sends its own every turn.
		a.items, a.followUp = t.Input, true
		body["previous_response_id"] = prev.id
		body["instructions"] = t.Instructions
	default:
		answer, err := json.Marshal(map[string]any{"type": "message", "role": "assistant",
			"content": []map[string]string{{"type": "output_text", "text": prev.answer}}})
		if err != nil {
			return a, err
		}
		a.items = append(append(append([]json.RawMessage(nil), prev.items...), answer), t.Input...)
		body["instructions"] = t.Instructions
	}
	body["input"] = a.items
	var err error
	if a.responses, err = json.Marshal(body); err != nil {
		return a, err
	}
	// The chat messages as vLLM derives them from the body (chatconv):
	// for a follow-up, from its input alone, after the stored history.
	conv, err := chatconv.FromResponses(a.responses)
	if err != nil {
		return a, err
	}
	if err := json.Unmarshal(conv.Messages, &a.messages); err != nil {
		return a, err
	}
	if a.followUp {
		// This turn's instructions, the stored history less its system
		// message, the stored answer, then this turn's input.
		answer, err := json.Marshal(map[string]string{"role": "assistant", "content": prev.answer})
		if err != nil {
			return a, err
		}
		msgs := append([]json.RawMessage(nil), a.messages[:1]...)
		for _, m := range prev.chat {
			if !bytes.HasPrefix(m, []byte(`{"role":"system"`)) {
				msgs = append(msgs, m)
			}
		}
		a.messages = append(append(msgs, answer), a.messages[1:]...)
	}
	chat := map[string]any{"model": model, "messages": a.messages, "max_tokens": maxTokens, "stream": true,
		"stream_options": map[string]bool{"include_usage": true}, "temperature": 0}
	if len(conv.Tools) > 0 {
		chat["tools"] = conv.Tools
	}
	a.chat, err = json.Marshal(chat)
	return a, err
}

// doAgent sends one agent turn, through the Responses API or (c.Chat) as
// chat completions, and keeps the answer for the conversation's next turn.
func (c *Client) doAgent(ctx context.Context, base string, r workload.Request) report.Record {
	rec := newRecord(base, r)
	t := r.Agent
	var prev *conversation
	if t.Turn > 0 {
		// Taken, not read: a turn that fails leaves no state, so the turns
		// after it are not sent on an older answer.
		v, ok := c.conversations.LoadAndDelete(t.Conversation)
		if !ok {
			rec.Err = "not sent: the previous turn failed"
			return rec
		}
		prev = v.(*conversation)
	}
	a, err := buildTurn(c.Model, t, r.MaxTokens, prev)
	if err != nil {
		rec.Err = err.Error()
		return rec
	}
	rec.FollowUp = a.followUp && !c.Chat
	url, raw := base+"/v1/responses", a.responses
	if c.Chat {
		url, raw = base+"/v1/chat/completions", a.chat
	}
	start := time.Now()
	resp := c.post(ctx, url, raw, r, &rec)
	if resp == nil {
		rec.StoredMissing = rec.FollowUp && rec.Status == 404
		return rec
	}
	defer resp.Body.Close()
	var text strings.Builder
	id := ""
	if c.Chat {
		readStream(ctx, resp.Body, start, &rec, &text)
	} else {
		id = readResponsesStream(ctx, resp.Body, start, &rec, &text)
	}
	rec.E2E = time.Since(start)
	if rec.Err == "" {
		c.conversations.Store(t.Conversation, &conversation{chat: a.messages, items: a.items, id: id, answer: text.String()})
	}
	return rec
}

// responsesEvent is the part of a Responses stream event the client reads.
type responsesEvent struct {
	Type     string `json:"type"`
	Delta    string `json:"delta"`
	Message  string `json:"message"`
	Response *struct {
		ID    string `json:"id"`
		Usage *struct {
			InputTokens        int `json:"input_tokens"`
			OutputTokens       int `json:"output_tokens"`
			InputTokensDetails *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
		} `json:"usage"`
	} `json:"response"`
}

// readResponsesStream reads a streamed Responses answer into rec: TTFT at
// the first output delta (text or a function call's arguments), usage and
// cached tokens from response.completed, the answer's text into text; it
// returns the response's id. A stream that fails, or ends before
// response.completed, is an error. Any byte sequence is handled without
// panicking.
func readResponsesStream(ctx context.Context, body io.Reader, start time.Time, rec *report.Record, text *strings.Builder) (id string) {
	br := bufio.NewReaderSize(body, 64<<10)
	completed := false
	for !completed {
		line, err := br.ReadSlice('\n')
		if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
			switch {
			case errors.Is(err, bufio.ErrBufferFull):
				rec.Err = "stream: SSE line over 64 KiB"
			case errors.Is(err, io.EOF):
				rec.Err = "stream ended without response.completed"
			default:
				rec.Err = classify(ctx, err, "stream")
			}
			return id
		}
		eof := errors.Is(err, io.EOF)
		data, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:"))
		if ok {
			var ev responsesEvent
			if err := json.Unmarshal(bytes.TrimSpace(data), &ev); err != nil {
				rec.Err = "stream: bad event: " + err.Error()
				return id
			}
			switch ev.Type {
			case "response.output_text.delta", "response.function_call_arguments.delta":
				if rec.TTFT == 0 {
					rec.TTFT = max(time.Since(start), time.Nanosecond)
				}
				if ev.Type == "response.output_text.delta" {
					text.WriteString(ev.Delta)
				}
			case "response.completed":
				completed = true
				if ev.Response != nil {
					id = ev.Response.ID
					if u := ev.Response.Usage; u != nil {
						rec.PromptTokens, rec.OutputTokens = u.InputTokens, u.OutputTokens
						if u.InputTokensDetails != nil {
							rec.ActualCached = u.InputTokensDetails.CachedTokens
						}
					}
				}
			case "error", "response.failed", "response.incomplete":
				rec.Err = "stream " + ev.Type + ": " + ev.Message
				return id
			}
		}
		if eof && !completed {
			rec.Err = "stream ended without response.completed"
			return id
		}
	}
	if rec.TTFT == 0 {
		rec.Err = "stream had no output"
	}
	return id
}
