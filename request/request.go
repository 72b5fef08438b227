// Package request reads the bodies of the OpenAI-compatible endpoints the
// router serves (vLLM's and SGLang's shapes): a chat, a completion, or a
// body passed through to an engine endpoint routed by model and load only.
// Parse validates a body and returns a Request, the plain values routing
// needs; everything else in the body is forwarded untouched. It also holds
// the rewrites the router makes to a body it forwards (asking a stream for
// its usage, continuing a broken stream).
package request

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

	"github.com/kvmesh/kvmesh/chatconv"
	"github.com/kvmesh/kvmesh/jsonscan"
	"github.com/kvmesh/kvmesh/tokenize"
)

// Kind is which endpoint a request came to, and so how its prompt is read.
type Kind uint8

const (
	// Chat is /v1/chat/completions: Messages are rendered by the model's
	// chat template.
	Chat Kind = iota
	// Completion is /v1/completions: a Prompt, as text or token ids.
	Completion
	// Passthrough is any other engine endpoint (embeddings, rerank,
	// audio...): forwarded as is, routed by model and load only.
	Passthrough
	// Responses is OpenAI's /v1/responses and Messages Anthropic's
	// /v1/messages: Parse converts their bodies into the chat Messages and
	// Tools vLLM renders them as (package chatconv), so that tokenizing and
	// planning treat them as a Chat. The body forwarded stays as sent.
	Responses
	Messages
)

// RendersAsChat reports whether requests of kind k are prompted through
// Messages and the chat template.
func (k Kind) RendersAsChat() bool { return k == Chat || k == Responses || k == Messages }

// Converted reports whether k's body is converted to a chat (Responses,
// Messages): its answers are in that API's shape, not chat completions'.
func (k Kind) Converted() bool { return k == Responses || k == Messages }

// Request is what routing needs of a validated body. Raw fields are spans
// of the body as sent (valid JSON; nil when absent). A LoRA adapter is
// asked for by Model, as vLLM has it (the router's settings say which names
// are adapters), and media in a chat are found where its messages are
// rendered (plan.Prompt.MediaPrefix), not here.
type Request struct {
	Kind Kind
	// Model is the model (or LoRA adapter) asked for; "" when the body
	// names none.
	Model string
	// Messages is a chat's array of message objects.
	Messages json.RawMessage
	// Prompt is a completion's prompt as sent; PromptText or PromptIDs
	// hold its first prompt, which decides the prefix of a batch.
	Prompt     json.RawMessage
	PromptText string
	PromptIDs  []uint32
	// Tools is a chat's tools array (nil when absent or null).
	Tools json.RawMessage
	// Stream is true when the client asked for a stream; WantsUsage when it
	// also asked for the usage chunk (stream_options.include_usage).
	Stream        bool
	WantsUsage    bool
	StreamOptions json.RawMessage
	// AddSpecialTokens, AddGenerationPrompt and ContinueFinalMessage are
	// vLLM's template options as sent (nil: not given, the endpoint's
	// default applies).
	AddSpecialTokens     *bool
	AddGenerationPrompt  *bool
	ContinueFinalMessage *bool
	ChatTemplateKwargs   json.RawMessage
	// CacheSalt is vLLM's cache_salt: prompts with different salts share
	// no cached blocks.
	CacheSalt string
	// MaxTokens is max_tokens or max_completion_tokens (max_output_tokens
	// for Responses), as sent.
	MaxTokens json.RawMessage
	// Unconvertible is why a Responses or Messages body cannot be turned
	// into the prompt vLLM renders (a *chatconv.InputError with Unsupported
	// set): such a request is routed by load, its body untouched.
	Unconvertible error
	// PreviousResponseID is the stored response a Responses request
	// continues: only the replica that stored it can serve it, and its
	// prompt starts with what that replica holds, not with Messages.
	PreviousResponseID string
	// Store is whether a Responses request asks the engine to keep its
	// response for follow-ups.
	Store bool
}

// fields are the top-level fields of a body that routing reads, as
// decodeTop fills them (encoding/json's reading of the same object).
type fields struct {
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
	MaxTokens            json.RawMessage `json:"max_tokens"`
}

// MaxTokensAsked is max_tokens (or max_completion_tokens) as a number, 0
// when unset or not one: what a quota counts for the answer in advance.
func (r *Request) MaxTokensAsked() int {
	if r == nil {
		return 0
	}
	n, err := strconv.Atoi(string(r.MaxTokens))
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// ShortAnswer reports a request asking for at most a few tokens: not worth
// watching its client while the engine works.
func (r *Request) ShortAnswer() bool {
	n, err := strconv.Atoi(string(r.MaxTokens))
	return err == nil && n <= 16
}

// ChatInput is the chat to render for r with vLLM's defaults: a generation
// prompt unless asked otherwise, special tokens only when asked for.
func (r *Request) ChatInput() tokenize.Chat {
	return tokenize.Chat{
		Messages:             r.Messages,
		Tools:                nullToNil(r.Tools),
		AddGenerationPrompt:  r.AddGenerationPrompt == nil || *r.AddGenerationPrompt,
		ContinueFinalMessage: r.ContinueFinalMessage != nil && *r.ContinueFinalMessage,
		TemplateKwargs:       nullToNil(r.ChatTemplateKwargs),
		AddSpecialTokens:     r.AddSpecialTokens != nil && *r.AddSpecialTokens,
	}
}

// PromptSpecialTokens reports whether a completion's text prompt is
// tokenized with special tokens (vLLM's default: yes).
func (r *Request) PromptSpecialTokens() bool { return r.AddSpecialTokens == nil || *r.AddSpecialTokens }

// Error is a client error with the HTTP status to answer and the OpenAI
// error type.
type Error struct {
	Status  int
	Type    string
	Message string
}

func (e *Error) Error() string { return e.Message }

// Invalid returns a 400 invalid_request_error.
func Invalid(format string, args ...any) *Error {
	return &Error{Status: 400, Type: "invalid_request_error", Message: fmt.Sprintf(format, args...)}
}

// Parse validates body for a Chat, a Completion, or a Responses or
// Messages request (converted to a chat). Bad input yields an *Error, never
// a panic.
func Parse(body []byte, k Kind) (*Request, error) {
	var f fields
	if err := decodeObject(body, &f); err != nil {
		return nil, err
	}
	r := &Request{Kind: k}
	r.take(&f)
	if len(f.StreamOptions) > 0 && !isNull(f.StreamOptions) {
		var so struct {
			IncludeUsage *bool `json:"include_usage"`
		}
		if err := json.Unmarshal(f.StreamOptions, &so); err != nil {
			return nil, Invalid("stream_options must be an object with a boolean include_usage")
		}
		r.WantsUsage = so.IncludeUsage != nil && *so.IncludeUsage
	}
	switch k {
	case Responses, Messages:
		if err := r.convert(body); err != nil {
			return nil, err
		}
	case Chat:
		if err := checkMessages(r.Messages); err != nil {
			return nil, err
		}
		if !isNull(r.Tools) && len(r.Tools) > 0 && r.Tools[0] != '[' {
			return nil, Invalid("tools must be an array")
		}
	case Completion:
		if err := r.parsePrompt(); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// convert fills r's chat from a Responses or Messages body, as vLLM derives
// it. A body vLLM refuses too is a 400; one whose prompt the router cannot
// reproduce keeps what routing by load needs, with Unconvertible set.
func (r *Request) convert(body []byte) error {
	from := chatconv.FromResponses
	if r.Kind == Messages {
		from = chatconv.FromMessages
	}
	c, err := from(body)
	var ie *chatconv.InputError
	switch {
	case errors.As(err, &ie) && ie.Unsupported:
		r.Messages, r.Tools, r.Unconvertible = nil, nil, err
		return nil
	case errors.As(err, &ie):
		return Invalid("%s: %s", ie.Field, ie.Reason)
	case err != nil:
		return Invalid("%v", err)
	}
	no := false
	r.Messages, r.Tools, r.ChatTemplateKwargs = c.Messages, c.Tools, c.TemplateKwargs
	r.AddGenerationPrompt, r.ContinueFinalMessage = &c.AddGenerationPrompt, &c.ContinueFinalMessage
	r.AddSpecialTokens = &no
	r.Stream, r.StreamOptions, r.WantsUsage = c.Stream, nil, false
	r.MaxTokens = nil
	if c.MaxOutputTokens >= 0 {
		r.MaxTokens = strconv.AppendInt(nil, int64(c.MaxOutputTokens), 10)
	}
	r.PreviousResponseID, r.Store = c.PreviousResponseID, c.Store
	if r.Kind == Messages {
		// vLLM's Anthropic handler builds its chat request without the
		// body's cache_salt (_build_base_request, 0001948b): the engine
		// keys those blocks unsalted.
		r.CacheSalt = ""
	}
	return nil
}

// ParseTokenize validates a body to vLLM's /tokenize, which takes either a
// chat's messages or a completion's prompt.
func ParseTokenize(body []byte) (*Request, error) {
	var probe struct {
		Messages json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &probe); err == nil && !isNull(probe.Messages) {
		return Parse(body, Chat)
	}
	return Parse(body, Completion)
}

// take copies the decoded fields into r.
func (r *Request) take(f *fields) {
	r.Model, r.Messages, r.Prompt, r.Tools = f.Model, f.Messages, f.Prompt, nullToNil(f.Tools)
	r.Stream = f.Stream != nil && *f.Stream
	r.StreamOptions = f.StreamOptions
	r.AddSpecialTokens, r.AddGenerationPrompt, r.ContinueFinalMessage = f.AddSpecialTokens, f.AddGenerationPrompt, f.ContinueFinalMessage
	r.ChatTemplateKwargs, r.MaxTokens = f.ChatTemplateKwargs, f.MaxTokens
	if f.CacheSalt != nil {
		r.CacheSalt = *f.CacheSalt
	}
}

// ParsePassthrough reads what routing needs from a body to a passed-through
// endpoint: the model and whether the answer streams. A multipart body
// (audio uploads; boundary is its Content-Type's boundary) gives them as
// form fields; any other body must be a JSON object, checked as chats are.
func ParsePassthrough(body []byte, boundary string) (*Request, error) {
	r := &Request{Kind: Passthrough}
	if boundary != "" {
		if err := r.formFields(body, boundary); err != nil {
			return nil, Invalid("malformed multipart body: %v", err)
		}
		return r, nil
	}
	var f fields
	if err := decodeObject(body, &f); err != nil {
		return nil, err
	}
	r.take(&f)
	return r, nil
}

// formFields reads the model and stream fields of a multipart body,
// skipping over the parts it does not need (the uploaded file) unread.
func (r *Request) formFields(body []byte, boundary string) error {
	mr := multipart.NewReader(bytes.NewReader(body), boundary)
	for {
		part, err := mr.NextPart()
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
			r.Model = string(v)
		} else {
			r.Stream = string(v) == "true"
		}
	}
}

// decodeObject checks that body is one valid JSON object in UTF-8 and
// reads the fields routing needs from it.
func decodeObject(body []byte, f *fields) error {
	if !utf8.Valid(body) {
		return Invalid("request body is not valid UTF-8")
	}
	if i := skipSpace(body, 0); i == len(body) || body[i] != '{' {
		return Invalid("request body must be a JSON object")
	}
	if !validJSON(body) {
		var v any
		err := json.Unmarshal(body, &v) // for the message only
		return Invalid("malformed JSON: %v", err)
	}
	return decodeTop(body, f)
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
		return Invalid("messages is required")
	}
	if raw[0] != '[' {
		return Invalid("messages must be an array of message objects")
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
		return Invalid("messages must not be empty")
	}
	if bad >= 0 {
		return Invalid("messages[%d] must be an object", bad)
	}
	return nil
}

// LeadingElements returns a JSON array of the first n elements of the
// array raw (validated already), reading no further.
func LeadingElements(raw []byte, n int) []byte {
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
func (r *Request) parsePrompt() error {
	raw := r.Prompt
	if isNull(raw) {
		return Invalid("prompt is required")
	}
	switch raw[0] {
	case '"':
		return unmarshalPrompt(raw, &r.PromptText)
	case '[':
	default:
		return Invalid("prompt must be a string, a list of strings or a list of token ids")
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil || len(items) == 0 {
		return Invalid("prompt must not be an empty list")
	}
	switch items[0][0] {
	case '"':
		return unmarshalPrompt(items[0], &r.PromptText)
	case '[':
		var ids []uint32
		if err := json.Unmarshal(items[0], &ids); err != nil || len(ids) == 0 {
			return Invalid("prompt[0] must be a non-empty list of token ids")
		}
		r.PromptIDs = ids
		return nil
	}
	var ids []uint32
	if err := json.Unmarshal(raw, &ids); err != nil {
		return Invalid("prompt must be a string, a list of strings or a list of token ids")
	}
	r.PromptIDs = ids
	return nil
}

func unmarshalPrompt(raw json.RawMessage, dst *string) error {
	return setString(dst, raw, "prompt")
}

// WithIncludeUsage returns body with stream_options.include_usage set to
// true, keeping every other field. The new stream_options is appended last:
// JSON decoders in Python and Go keep the last of duplicate keys.
func WithIncludeUsage(body []byte, streamOptions json.RawMessage) ([]byte, error) {
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
	return appendField(body, "stream_options", enc)
}

// WithPriority returns body with vLLM's request priority set to n (lower is
// served first, under --scheduling-policy priority), appended last so that
// it wins over a priority the client sent.
func WithPriority(body []byte, n int) ([]byte, error) {
	return appendField(body, "priority", strconv.AppendInt(nil, int64(n), 10))
}

// appendField appends "key":value as the last member of the JSON object
// body: JSON decoders in Python and Go keep the last of duplicate keys.
func appendField(body []byte, key string, value []byte) ([]byte, error) {
	return appendMembers(body, `"`+key+`":`+string(value))
}

// appendMembers appends members (`"k":v,...`) as the last of the JSON
// object body, in one copy of it.
func appendMembers(body []byte, members string) ([]byte, error) {
	end := bytes.LastIndexByte(body, '}')
	start := bytes.IndexByte(body, '{')
	if end < 0 || start < 0 || start > end {
		return nil, errors.New("request: body is not an object")
	}
	inner := bytes.TrimSpace(body[start+1 : end])
	out := make([]byte, 0, len(body)+len(members)+1)
	out = append(out, body[:end]...)
	if len(inner) > 0 {
		out = append(out, ',')
	}
	out = append(out, members...)
	out = append(out, body[end:]...)
	return out, nil
}

// Continuation is the body that asks an engine to go on with a stream from
// text, what the client has received: for a chat, text as a final assistant
// message to continue (continue_final_message, which vLLM and SGLang
// accept); for a completion, the prompt followed by text. max_tokens and
// max_completion_tokens shrink by chunks, the tokens already generated (the
// caller's best count: events that carried text, or text re-tokenized). With
// no text yet the request is sent again as it was. False when it cannot be
// continued that way: several choices, echo, a prompt of token ids or a
// batch, a chat that already continues its last message, no tokens left.
func Continuation(body []byte, k Kind, text []byte, chunks int) ([]byte, bool) {
	var obj map[string]json.RawMessage
	if json.Unmarshal(body, &obj) != nil {
		return nil, false
	}
	if n, ok := obj["n"]; ok && !isNull(n) && string(bytes.TrimSpace(n)) != "1" {
		return nil, false
	}
	if string(bytes.TrimSpace(obj["echo"])) == "true" {
		return nil, false
	}
	if len(text) == 0 {
		return body, true
	}
	for _, key := range []string{"max_tokens", "max_completion_tokens"} {
		raw, ok := obj[key]
		if !ok || isNull(raw) {
			continue
		}
		var n int
		if json.Unmarshal(raw, &n) != nil || n-chunks <= 0 {
			return nil, false
		}
		obj[key] = json.RawMessage(strconv.Itoa(n - chunks))
	}
	said, err := json.Marshal(string(text))
	if err != nil {
		return nil, false
	}
	switch k {
	case Chat:
		if string(bytes.TrimSpace(obj["continue_final_message"])) == "true" {
			return nil, false
		}
		var msgs []json.RawMessage
		if json.Unmarshal(obj["messages"], &msgs) != nil {
			return nil, false
		}
		msgs = append(msgs, json.RawMessage(`{"role":"assistant","content":`+string(said)+`}`))
		if obj["messages"], err = json.Marshal(msgs); err != nil {
			return nil, false
		}
		obj["continue_final_message"] = json.RawMessage("true")
		obj["add_generation_prompt"] = json.RawMessage("false")
	default:
		var prompt string
		if json.Unmarshal(obj["prompt"], &prompt) != nil {
			return nil, false
		}
		if obj["prompt"], err = json.Marshal(prompt + string(text)); err != nil {
			return nil, false
		}
	}
	out, err := json.Marshal(obj)
	return out, err == nil
}

func nullToNil(raw []byte) []byte {
	if isNull(raw) {
		return nil
	}
	return raw
}
