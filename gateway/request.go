package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"strconv"
	"unicode/utf8"

	segjson "github.com/segmentio/encoding/json"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/jsonscan"
)

// kind is which OpenAI endpoint a request came to.
type kind uint8

const (
	kindChat kind = iota
	kindCompletion
	// kindOther is any other engine endpoint (embeddings, responses,
	// rerank, audio...): passed through, routed by model and load only.
	kindOther
)

// apiRequest is the part of a chat or completions body that routing needs.
// Everything else is forwarded untouched.
type apiRequest struct {
	Model                string          `json:"model"`
	Messages             json.RawMessage `json:"messages"`
	Prompt               json.RawMessage `json:"prompt"`
	Tools                json.RawMessage `json:"tools"`
	Stream               *bool           `json:"stream"`
	StreamOptions        json.RawMessage `json:"stream_options"`
	AddSpecialTokens     *bool           `json:"add_special_tokens"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage *bool           `json:"continue_final_message"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
	CacheSalt            *string         `json:"cache_salt"`
	// MaxTokens is max_tokens or max_completion_tokens, as sent.
	MaxTokens json.RawMessage `json:"max_tokens"`
}

// shortAnswer reports a request asking for at most a few tokens: not worth
// watching its client while the engine works.
func (r *apiRequest) shortAnswer() bool {
	n, err := strconv.Atoi(string(r.MaxTokens))
	return err == nil && n <= 16
}

// requestError is a client error with the HTTP status to answer.
type requestError struct {
	status int
	typ    string
	msg    string
}

func (e *requestError) Error() string { return e.msg }

func badRequest(format string, args ...any) *requestError {
	return &requestError{status: 400, typ: "invalid_request_error", msg: fmt.Sprintf(format, args...)}
}

// parsed is a validated request.
type parsed struct {
	apiRequest
	kind   kind
	stream bool
	// wantsUsage is true when a streaming client asked for the usage chunk.
	wantsUsage bool
	// promptIDs holds a completions prompt given as token ids.
	promptIDs []uint32
	// promptText holds a completions prompt given as text (the first one of
	// a batch: it decides the prefix).
	promptText string
}

// parseRequest validates body for endpoint k. Bad input yields a
// *requestError, never a panic.
func parseRequest(body []byte, k kind) (*parsed, error) {
	p := &parsed{kind: k}
	if err := p.decodeObject(body); err != nil {
		return nil, err
	}
	if len(p.StreamOptions) > 0 && !isNull(p.StreamOptions) {
		var so struct {
			IncludeUsage *bool `json:"include_usage"`
		}
		if err := json.Unmarshal(p.StreamOptions, &so); err != nil {
			return nil, badRequest("stream_options must be an object with a boolean include_usage")
		}
		p.wantsUsage = so.IncludeUsage != nil && *so.IncludeUsage
	}
	switch k {
	case kindChat:
		if err := checkMessages(p.Messages); err != nil {
			return nil, err
		}
		if !isNull(p.Tools) && len(p.Tools) > 0 && p.Tools[0] != '[' {
			return nil, badRequest("tools must be an array")
		}
	case kindCompletion:
		if err := p.parsePrompt(); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// parseOther reads what routing needs from a request to a passed-through
// endpoint: the model and whether the answer streams. A multipart body
// (audio uploads) gives them as form fields; any other body must be a JSON
// object, checked as chats are.
func parseOther(ctx *fasthttp.RequestCtx) (*parsed, error) {
	p := &parsed{kind: kindOther}
	if boundary := ctx.Request.Header.MultipartFormBoundary(); len(boundary) > 0 {
		if err := p.formFields(ctx.PostBody(), string(boundary)); err != nil {
			return nil, badRequest("malformed multipart body: %v", err)
		}
		return p, nil
	}
	if err := p.decodeObject(ctx.PostBody()); err != nil {
		return nil, err
	}
	return p, nil
}

// formFields reads the model and stream fields of a multipart body,
// skipping over the parts it does not need (the uploaded file) unread.
func (p *parsed) formFields(body []byte, boundary string) error {
	r := multipart.NewReader(bytes.NewReader(body), boundary)
	for {
		part, err := r.NextPart()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		name := part.FormName()
		if name != "model" && name != "stream" {
			continue
		}
		v, err := io.ReadAll(io.LimitReader(part, 1024))
		if err != nil {
			return err
		}
		if name == "model" {
			p.Model = string(v)
		} else {
			p.stream = string(v) == "true"
		}
	}
}

// decodeObject checks that body is one valid JSON object in UTF-8 and
// reads the fields routing needs from it.
func (p *parsed) decodeObject(body []byte) error {
	if !utf8.Valid(body) {
		return badRequest("request body is not valid UTF-8")
	}
	if i := skipSpace(body, 0); i == len(body) || body[i] != '{' {
		return badRequest("request body must be a JSON object")
	}
	if !validJSON(body) {
		var v any
		err := json.Unmarshal(body, &v) // for the message only
		return badRequest("malformed JSON: %v", err)
	}
	if err := decodeTop(body, &p.apiRequest); err != nil {
		return err
	}
	p.stream = p.Stream != nil && *p.Stream
	return nil
}

// validJSON is json.Valid, faster. segmentio's Valid accepts what
// encoding/json's does at ≈18× the speed on a 4 KB chat (0.6 µs instead of
// 11.5), but has a fixed cost that makes it slower below a few hundred
// bytes (354 ns vs 210 ns for a 55-byte completion). It recurses once per
// level without a limit, so nesting is bounded first, at encoding/json's
// limit: the two then agree on every body (FuzzValidMatchesStdlib), and a
// body nested millions deep is a 400, not a stack overflow.
func validJSON(body []byte) bool {
	if len(body) < 256 {
		return json.Valid(body)
	}
	return jsonscan.DepthWithin(body, jsonscan.MaxDepth) && segjson.Valid(body)
}

func isNull(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }

func checkMessages(raw json.RawMessage) error {
	if isNull(raw) {
		return badRequest("messages is required")
	}
	if raw[0] != '[' {
		return badRequest("messages must be an array of message objects")
	}
	n := 0
	bad := -1
	eachElement(raw, func(elem []byte) bool {
		if bad < 0 && elem[0] != '{' {
			bad = n
		}
		n++
		return true
	})
	if n == 0 {
		return badRequest("messages must not be empty")
	}
	if bad >= 0 {
		return badRequest("messages[%d] must be an object", bad)
	}
	return nil
}

// leadingElements returns a JSON array of the first n elements of the
// array raw (validated already), reading no further.
func leadingElements(raw []byte, n int) []byte {
	out := []byte{'['}
	if n <= 0 {
		return append(out, ']')
	}
	i := 0
	eachElement(raw, func(elem []byte) bool {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, elem...)
		i++
		return i < n
	})
	return append(out, ']')
}

// eachElement calls f with each element of the JSON array raw, which the
// JSON decoder has already validated, until f returns false: one pass, no
// allocation (cheaper than decoding it again).
func eachElement(raw []byte, f func(elem []byte) bool) {
	depth, start := 0, -1
	for i := 0; i < len(raw); i++ {
		c := raw[i]
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		case '"':
			if depth >= 1 && start < 0 {
				start = i
			}
			i = jsonscan.StringEnd(raw, i+1) - 1
			continue
		case '[', '{':
			depth++
			if depth == 1 {
				continue
			}
		case ']', '}':
			depth--
			if depth == 0 {
				if start >= 0 {
					f(raw[start:i])
				}
				return
			}
		case ',':
			if depth == 1 {
				if !f(raw[start:i]) {
					return
				}
				start = -1
				continue
			}
		}
		if depth >= 1 && start < 0 {
			start = i
		}
	}
}

// parsePrompt accepts the prompt shapes vLLM does: a string, a list of
// strings, a list of token ids, or a list of lists of token ids. A batch
// routes by its first prompt.
func (p *parsed) parsePrompt() error {
	raw := p.Prompt
	if isNull(raw) {
		return badRequest("prompt is required")
	}
	switch raw[0] {
	case '"':
		return unmarshalPrompt(raw, &p.promptText)
	case '[':
	default:
		return badRequest("prompt must be a string, a list of strings or a list of token ids")
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil || len(items) == 0 {
		return badRequest("prompt must not be an empty list")
	}
	switch items[0][0] {
	case '"':
		return unmarshalPrompt(items[0], &p.promptText)
	case '[':
		var ids []uint32
		if err := json.Unmarshal(items[0], &ids); err != nil || len(ids) == 0 {
			return badRequest("prompt[0] must be a non-empty list of token ids")
		}
		p.promptIDs = ids
		return nil
	}
	var ids []uint32
	if err := json.Unmarshal(raw, &ids); err != nil {
		return badRequest("prompt must be a string, a list of strings or a list of token ids")
	}
	p.promptIDs = ids
	return nil
}

func unmarshalPrompt(raw json.RawMessage, dst *string) error {
	return setString(dst, raw, "prompt")
}

// withIncludeUsage returns body with stream_options.include_usage set to
// true, keeping every other field. The new stream_options is appended last:
// JSON decoders in Python and Go keep the last of duplicate keys.
func withIncludeUsage(body []byte, streamOptions json.RawMessage) ([]byte, error) {
	opts := map[string]json.RawMessage{}
	if !isNull(streamOptions) {
		if err := json.Unmarshal(streamOptions, &opts); err != nil {
			return nil, err
		}
	}
	opts["include_usage"] = json.RawMessage("true")
	enc, err := json.Marshal(opts)
	if err != nil {
		return nil, err
	}
	end := bytes.LastIndexByte(body, '}')
	if end < 0 {
		return nil, errors.New("gateway: body is not an object")
	}
	inner := bytes.TrimSpace(body[bytes.IndexByte(body, '{')+1 : end])
	out := make([]byte, 0, len(body)+len(enc)+20)
	out = append(out, body[:end]...)
	if len(inner) > 0 {
		out = append(out, ',')
	}
	out = append(out, `"stream_options":`...)
	out = append(out, enc...)
	out = append(out, body[end:]...)
	return out, nil
}

// continuation is the body that asks an engine to go on with a stream from
// text, what the client has received: for a chat, text as a final assistant
// message to continue (continue_final_message, which vLLM and SGLang
// accept); for a completion, the prompt followed by text. max_tokens and
// max_completion_tokens shrink by chunks, the tokens already generated (the
// caller's best count: events that carried text, or text re-tokenized). With
// no text yet the request is sent again as it was. False when it cannot be
// continued that way: several choices, echo, a prompt of token ids or a
// batch, a chat that already continues its last message, no tokens left.
func continuation(body []byte, k kind, text []byte, chunks int) ([]byte, bool) {
	var fields map[string]json.RawMessage
	if json.Unmarshal(body, &fields) != nil {
		return nil, false
	}
	if n, ok := fields["n"]; ok && !isNull(n) && string(bytes.TrimSpace(n)) != "1" {
		return nil, false
	}
	if string(bytes.TrimSpace(fields["echo"])) == "true" {
		return nil, false
	}
	if len(text) == 0 {
		return body, true
	}
	for _, key := range []string{"max_tokens", "max_completion_tokens"} {
		raw, ok := fields[key]
		if !ok || isNull(raw) {
			continue
		}
		var n int
		if json.Unmarshal(raw, &n) != nil || n-chunks <= 0 {
			return nil, false
		}
		fields[key] = json.RawMessage(strconv.Itoa(n - chunks))
	}
	said, err := json.Marshal(string(text))
	if err != nil {
		return nil, false
	}
	switch k {
	case kindChat:
		if string(bytes.TrimSpace(fields["continue_final_message"])) == "true" {
			return nil, false
		}
		var msgs []json.RawMessage
		if json.Unmarshal(fields["messages"], &msgs) != nil {
			return nil, false
		}
		msgs = append(msgs, json.RawMessage(`{"role":"assistant","content":`+string(said)+`}`))
		if fields["messages"], err = json.Marshal(msgs); err != nil {
			return nil, false
		}
		fields["continue_final_message"] = json.RawMessage("true")
		fields["add_generation_prompt"] = json.RawMessage("false")
	default:
		var prompt string
		if json.Unmarshal(fields["prompt"], &prompt) != nil {
			return nil, false
		}
		if fields["prompt"], err = json.Marshal(prompt + string(text)); err != nil {
			return nil, false
		}
	}
	out, err := json.Marshal(fields)
	return out, err == nil
}
