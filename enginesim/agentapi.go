package enginesim

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/chatconv"
	"github.com/kvmesh/kvmesh/engine"
)

// The Responses (/v1/responses) and Messages (/v1/messages) endpoints, as
// vLLM serves them on its chat path (vllm/entrypoints/openai/responses/
// serving.py and vllm/entrypoints/anthropic/serving.py at 0001948b, with
// responses/utils.py's construct_input_messages at 01ca842d): the
// body becomes the chat messages vLLM derives (package chatconv, which
// follows the same code), generated like a chat, answered in the API's own
// shape with usage and cached tokens. Responses with store (true unless
// sent false) are kept in this process, as with
// VLLM_ENABLE_RESPONSES_API_STORE=1: previous_response_id continues one
// (its messages and output before the new input) and
// GET /v1/responses/{id} retrieves it; an unknown id is vLLM's 404.

// agentAPI is which of the two APIs a request came to.
type agentAPI uint8

const (
	responsesAPI agentAPI = iota + 1
	messagesAPI
)

// agentAnswer is what rendering a Responses or Messages answer needs.
type agentAnswer struct {
	api       agentAPI
	id        string // resp_… or msg_…
	itemID    string // a response's output message
	model     string
	maxOutput int // as sent, -1 for none
	previous  string
	store     bool
	messages  []json.RawMessage // the chat the prompt was rendered from
	text      []byte            // output so far
	seq       int               // a Responses stream's sequence_number
}

// storedResponse is a Responses answer kept for follow-ups and retrieval.
type storedResponse struct {
	body     []byte
	messages []json.RawMessage
	output   string
}

// responseStore keeps stored responses, never dropping one (as vLLM's).
type responseStore struct {
	mu sync.Mutex
	m  map[string]*storedResponse
}

func (st *responseStore) get(id string) *storedResponse {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.m[id]
}

func (st *responseStore) put(id string, r *storedResponse) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.m == nil {
		st.m = map[string]*storedResponse{}
	}
	st.m[id] = r
}

func responseNotFound(ctx *fasthttp.RequestCtx, id string) {
	writeError(ctx, fasthttp.StatusNotFound, "invalid_request_error", fmt.Sprintf("Response with id '%s' not found.", id))
}

// agentGenerate serves POST /v1/responses and /v1/messages.
func (s *Server) agentGenerate(ctx *fasthttp.RequestCtx, api agentAPI) {
	body := ctx.PostBody()
	if _, rerr := s.parseRequest(body); rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	from := chatconv.FromResponses
	if api == messagesAPI {
		from = chatconv.FromMessages
	}
	c, err := from(body)
	var ie *chatconv.InputError
	if errors.As(err, &ie) && ie.Unsupported {
		err = nil // vLLM serves it; the simulator renders what chatconv made of it
	}
	if err != nil {
		badRequest(ctx, err.Error())
		return
	}
	var msgs []json.RawMessage
	if err := json.Unmarshal(c.Messages, &msgs); err != nil {
		badRequest(ctx, err.Error())
		return
	}
	if c.PreviousResponseID != "" {
		prev := s.responses.get(c.PreviousResponseID)
		if prev == nil {
			responseNotFound(ctx, c.PreviousResponseID)
			return
		}
		// construct_input_messages (01ca842d): this request's
		// instructions, the stored messages less their system messages
		// (instructions do not carry over), the stored output, then the
		// new input.
		var lead []json.RawMessage
		if len(msgs) > 0 && isSystem(msgs[0]) && hasInstructions(body) {
			lead, msgs = msgs[:1], msgs[1:]
		}
		all := append([]json.RawMessage{}, lead...)
		for _, m := range prev.messages {
			if !isSystem(m) {
				all = append(all, m)
			}
		}
		out, _ := json.Marshal(map[string]string{"role": "assistant", "content": prev.output})
		msgs = append(append(all, out), msgs...)
		if c.Messages, err = json.Marshal(msgs); err != nil {
			badRequest(ctx, err.Error())
			return
		}
	}
	_, ids, err := s.cfg.Tokenizer.EncodeChat(c.Tokenize())
	if err != nil {
		badRequest(ctx, err.Error())
		return
	}
	var maxTokens *int
	if c.MaxOutputTokens >= 0 {
		maxTokens = &c.MaxOutputTokens
	}
	n, rerr := s.maxTokens(&apiRequest{MaxTokens: maxTokens}, false, len(ids))
	if rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	a := &agentAnswer{api: api, model: s.cfg.Model, maxOutput: c.MaxOutputTokens, previous: c.PreviousResponseID,
		store: api == responsesAPI && c.Store, messages: msgs}
	next := s.nextID.Add(1) // the answer's own name, unique per server
	if api == responsesAPI {
		a.id, a.itemID = "resp_"+s.idPrefix+strconv.FormatUint(next, 16), "msg_"+s.idPrefix+strconv.FormatUint(next, 16)
	} else {
		a.id = "msg_" + s.idPrefix + strconv.FormatUint(next, 16)
	}
	s.run(ctx, &response{s: s, chat: true, agent: a}, engine.Request{Prompt: ids, MaxTokens: n}, nil, c.Stream)
}

// isSystem reports a system message.
func isSystem(m json.RawMessage) bool {
	var v struct {
		Role string `json:"role"`
	}
	return json.Unmarshal(m, &v) == nil && v.Role == "system"
}

// hasInstructions reports a Responses body with non-empty instructions,
// which chatconv puts first as a system message.
func hasInstructions(body []byte) bool {
	var b struct {
		Instructions *string `json:"instructions"`
	}
	return json.Unmarshal(body, &b) == nil && b.Instructions != nil && *b.Instructions != ""
}

// serveStored serves GET /v1/responses/{id} and POST .../{id}/cancel.
func (s *Server) serveStored(ctx *fasthttp.RequestCtx, rest string) {
	id, action, _ := strings.Cut(rest, "/")
	method := string(ctx.Method())
	switch {
	case action == "" && method == fasthttp.MethodGet, action == "cancel" && method == fasthttp.MethodPost:
	default:
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"detail":"Not Found"}`)
		return
	}
	r := s.responses.get(id)
	if r == nil {
		responseNotFound(ctx, id)
		return
	}
	if action == "cancel" {
		writeError(ctx, fasthttp.StatusBadRequest, "invalid_request_error", "Cannot cancel a synchronous response.")
		return
	}
	ctx.SetContentType("application/json")
	ctx.SetBody(r.body)
}

// agentFull renders a whole answer (and stores a response asked to be).
func (r *response) agentFull(b []byte, toks []uint32) []byte {
	for _, t := range toks {
		r.agent.text = append(r.agent.text, r.s.vocabText[t]...)
	}
	if r.agent.api == messagesAPI {
		return r.anthropicMessage(b, true)
	}
	b = r.responseObject(b, "completed")
	r.keep(b)
	return b
}

// keep stores a finished response asked to be stored.
func (r *response) keep(obj []byte) {
	if a := r.agent; a.store {
		r.s.responses.put(a.id, &storedResponse{body: append([]byte(nil), obj...), messages: a.messages, output: string(a.text)})
	}
}

// responseObject is vLLM's ResponsesResponse for the answer so far.
func (r *response) responseObject(b []byte, status string) []byte {
	a := r.agent
	b = append(b, `{"id":"`...)
	b = append(b, a.id...)
	b = append(b, `","created_at":`...)
	b = strconv.AppendInt(b, r.created, 10)
	b = append(b, `,"incomplete_details":null,"instructions":null,"metadata":null,"model":`...)
	b = appendJSONString(b, a.model)
	b = append(b, `,"object":"response","output":[`...)
	if status == "completed" {
		b = r.outputMessage(b, "completed")
	}
	b = append(b, `],"parallel_tool_calls":true,"temperature":1.0,"tool_choice":"auto","tools":[],"top_p":1.0,"background":false,"max_output_tokens":`...)
	if a.maxOutput >= 0 {
		b = strconv.AppendInt(b, int64(a.maxOutput), 10)
	} else {
		b = append(b, "null"...)
	}
	b = append(b, `,"max_tool_calls":null,"previous_response_id":`...)
	if a.previous != "" {
		b = appendJSONString(b, a.previous)
	} else {
		b = append(b, "null"...)
	}
	b = append(b, `,"prompt":null,"reasoning":null,"service_tier":"auto","status":"`...)
	b = append(b, status...)
	b = append(b, `","text":null,"top_logprobs":null,"truncation":"disabled","usage":`...)
	if status == "completed" {
		b = append(b, `{"input_tokens":`...)
		b = strconv.AppendInt(b, int64(r.promptLen), 10)
		b = append(b, `,"input_tokens_details":{"cached_tokens":`...)
		b = strconv.AppendInt(b, int64(r.cached), 10)
		b = append(b, `},"output_tokens":`...)
		b = strconv.AppendInt(b, int64(r.completion), 10)
		b = append(b, `,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":`...)
		b = strconv.AppendInt(b, int64(r.promptLen+r.completion), 10)
		b = append(b, '}')
	} else {
		b = append(b, "null"...)
	}
	return append(b, `,"user":null}`...)
}

// outputMessage is the answer's output message item.
func (r *response) outputMessage(b []byte, status string) []byte {
	b = append(b, `{"id":"`...)
	b = append(b, r.agent.itemID...)
	b = append(b, `","content":[{"annotations":[],"text":`...)
	b = appendJSONString(b, string(r.agent.text))
	b = append(b, `,"type":"output_text","logprobs":null}],"role":"assistant","status":"`...)
	b = append(b, status...)
	return append(b, `","type":"message"}`...)
}

// anthropicMessage is vLLM's AnthropicMessagesResponse: input_tokens the
// uncached part of the prompt, cache_read_input_tokens the cached part.
func (r *response) anthropicMessage(b []byte, done bool) []byte {
	b = append(b, `{"id":"`...)
	b = append(b, r.agent.id...)
	b = append(b, `","type":"message","role":"assistant","content":[`...)
	if done {
		b = append(b, `{"type":"text","text":`...)
		b = appendJSONString(b, string(r.agent.text))
		b = append(b, '}')
	}
	b = append(b, `],"model":`...)
	b = appendJSONString(b, r.agent.model)
	if done {
		b = append(b, `,"stop_reason":"max_tokens"`...)
	} else {
		b = append(b, `,"stop_reason":null`...)
	}
	b = append(b, `,"stop_sequence":null,"usage":`...)
	return append(r.anthropicUsage(b), '}')
}

func (r *response) anthropicUsage(b []byte) []byte {
	b = append(b, `{"input_tokens":`...)
	b = strconv.AppendInt(b, int64(r.promptLen-r.cached), 10)
	b = append(b, `,"cache_read_input_tokens":`...)
	b = strconv.AppendInt(b, int64(r.cached), 10)
	b = append(b, `,"output_tokens":`...)
	b = strconv.AppendInt(b, int64(r.completion), 10)
	return append(b, '}')
}

// event appends one SSE event as vLLM sends these APIs': its type on an
// "event:" line, its JSON on a "data:" line. A Responses event's JSON gets
// its sequence_number.
func (r *response) event(b []byte, typ string, body func([]byte) []byte) []byte {
	b = append(b, "event: "...)
	b = append(b, typ...)
	b = append(b, "\ndata: {\"type\":\""...)
	b = append(b, typ...)
	b = append(b, '"')
	b = body(b)
	if r.agent.api == responsesAPI {
		b = append(b, `,"sequence_number":`...)
		b = strconv.AppendInt(b, int64(r.agent.seq), 10)
		r.agent.seq++
	}
	return append(b, "}\n\n"...)
}

// agentPrelude: a Responses stream opens with response.created and
// response.in_progress before prefill.
func (r *response) agentPrelude(b []byte) []byte {
	if r.agent.api != responsesAPI {
		return b
	}
	for _, typ := range []string{"response.created", "response.in_progress"} {
		b = r.event(b, typ, func(b []byte) []byte {
			return r.responseObject(append(b, `,"response":`...), "in_progress")
		})
	}
	return b
}

// agentOpening comes with the first tokens.
func (r *response) agentOpening(b []byte) []byte {
	if r.agent.api == messagesAPI {
		b = r.event(b, "message_start", func(b []byte) []byte {
			return r.anthropicMessage(append(b, `,"message":`...), false)
		})
		return r.event(b, "content_block_start", func(b []byte) []byte {
			return append(b, `,"index":0,"content_block":{"type":"text","text":""}`...)
		})
	}
	b = r.event(b, "response.output_item.added", func(b []byte) []byte {
		return r.outputMessage(append(b, `,"output_index":0,"item":`...), "in_progress")
	})
	return r.event(b, "response.content_part.added", func(b []byte) []byte {
		return r.itemRef(append(b, `,"part":{"annotations":[],"text":"","type":"output_text","logprobs":null}`...))
	})
}

func (r *response) itemRef(b []byte) []byte {
	b = append(b, `,"item_id":"`...)
	b = append(b, r.agent.itemID...)
	return append(b, `","output_index":0,"content_index":0`...)
}

// agentPiece is one piece of text.
func (r *response) agentPiece(b []byte, text string, _ bool) []byte {
	if text == "" {
		return b
	}
	r.agent.text = append(r.agent.text, text...)
	if r.agent.api == messagesAPI {
		return r.event(b, "content_block_delta", func(b []byte) []byte {
			b = append(b, `,"index":0,"delta":{"type":"text_delta","text":`...)
			return append(appendJSONString(b, text), '}')
		})
	}
	return r.event(b, "response.output_text.delta", func(b []byte) []byte {
		b = append(r.itemRef(b), `,"delta":`...)
		return append(appendJSONString(b, text), `,"logprobs":[]`...)
	})
}

// agentClosing ends the stream with the final usage.
func (r *response) agentClosing(b []byte) []byte {
	if r.agent.api == messagesAPI {
		b = r.event(b, "content_block_stop", func(b []byte) []byte { return append(b, `,"index":0`...) })
		b = r.event(b, "message_delta", func(b []byte) []byte {
			return r.anthropicUsage(append(b, `,"delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":`...))
		})
		return r.event(b, "message_stop", func(b []byte) []byte { return b })
	}
	b = r.event(b, "response.output_text.done", func(b []byte) []byte {
		b = append(r.itemRef(b), `,"text":`...)
		return append(appendJSONString(b, string(r.agent.text)), `,"logprobs":[]`...)
	})
	b = r.event(b, "response.content_part.done", func(b []byte) []byte {
		b = append(r.itemRef(b), `,"part":{"annotations":[],"text":`...)
		return append(appendJSONString(b, string(r.agent.text)), `,"type":"output_text","logprobs":null}`...)
	})
	b = r.event(b, "response.output_item.done", func(b []byte) []byte {
		return r.outputMessage(append(b, `,"output_index":0,"item":`...), "completed")
	})
	var obj []byte
	b = r.event(b, "response.completed", func(b []byte) []byte {
		n := len(b) + len(`,"response":`)
		b = r.responseObject(append(b, `,"response":`...), "completed")
		obj = b[n:]
		return b
	})
	r.keep(obj)
	return b
}
