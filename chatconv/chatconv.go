// Package chatconv turns OpenAI Responses (/v1/responses) and Anthropic
// Messages (/v1/messages) request bodies into the chat-completions messages
// and tools vLLM builds from them before it applies the chat template, so
// that a router can render and tokenize the very prompt the engine will, as
// it does for chat completions. It also reads the cached-token counts these
// APIs report back (usage.go).
//
// The conversion follows vLLM's own code, read (never copied) at these
// revisions of vllm-project/vllm's main branch:
//
//   - Responses: vllm/entrypoints/openai/responses/utils.py
//     (construct_input_messages, construct_tool_dicts; 01ca842d),
//     responses/protocol.py (ResponsesRequest, its function_call_parsing
//     validator, build_chat_params; 010a69ce) and responses/serving.py
//     (_make_request; 0001948b), with vllm/tool_parsers/utils.py
//     (iter_response_function_tool_dicts; 0064cc9c) and openai-python's
//     FunctionTool (306e7b69);
//   - Messages: vllm/entrypoints/anthropic/serving.py
//     (_convert_anthropic_to_openai_request; 0001948b) and
//     anthropic/protocol.py (00589e56), which hand a ChatCompletionRequest to
//     vLLM's chat serving, whose build_chat_params
//     (openai/chat_completion/protocol.py; 002032ee) decides the template
//     arguments.
//
// Chat.Messages is the list vLLM passes to parse_chat_messages: package
// chattemplate applies that step and the template, as for a chat request.
// What the router cannot reproduce is reported as an *InputError with
// Unsupported set, so the caller routes such a request by load instead of by
// a prefix the engine will not see; see the functions' docs for the cases.
package chatconv

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/kvmesh/kvmesh/jsonscan"
	"github.com/kvmesh/kvmesh/tokenize"
)

// Limits on the outside input this package decodes.
const (
	// MaxBodyBytes bounds a request body; larger ones are refused.
	MaxBodyBytes = 64 << 20
	// MaxDepth bounds JSON nesting (tool schemas nest; real requests stay
	// far below it).
	MaxDepth = 512
)

// Chat is a Responses or Messages request in the chat-completions shape vLLM
// renders it in.
type Chat struct {
	// Model is the model named by the request ("" when a Responses request
	// names none).
	Model string
	// Messages is the JSON array of chat messages vLLM derives.
	Messages json.RawMessage
	// Tools is the JSON array of chat-completions function tools vLLM hands
	// the template, nil for none (the template sees tools = none).
	Tools json.RawMessage
	// ToolChoice is the request's tool choice in the chat-completions shape
	// ("auto", "none", "required" or a named function), nil when unset.
	ToolChoice json.RawMessage
	// AddGenerationPrompt and ContinueFinalMessage are the template
	// arguments vLLM sets: a Responses request whose last item is an
	// unfinished assistant message or reasoning item is continued.
	AddGenerationPrompt, ContinueFinalMessage bool
	// TemplateKwargs is the JSON object of further template variables
	// (reasoning_effort, and a Messages request's chat_template_kwargs), nil
	// for none.
	TemplateKwargs json.RawMessage
	// Stream is true when the answer is an event stream.
	Stream bool
	// MaxOutputTokens is max_output_tokens (Responses) or max_tokens
	// (Messages), -1 when unset.
	MaxOutputTokens int
	// PreviousResponseID names the stored response a Responses request
	// continues. vLLM then prepends that response's messages and output,
	// which only the replica that stored it holds: Messages here are the
	// request's own part alone, and such a request belongs to that replica
	// whatever its prefix.
	PreviousResponseID string
	// Store is whether a Responses request asks vLLM to keep the response
	// (true unless the body says false or null); false for Messages.
	Store bool
}

// Tokenize returns the chat as package tokenize renders it, with vLLM's
// defaults for the rest: no special tokens added, since templates write
// their own (vLLM's Responses path added them, a second BOS for templates
// that write one, until ResponsesRequest.build_tok_params set
// add_special_tokens=False as its chat path does).
func (c *Chat) Tokenize() tokenize.Chat {
	return tokenize.Chat{
		Messages:             c.Messages,
		Tools:                c.Tools,
		AddGenerationPrompt:  c.AddGenerationPrompt,
		ContinueFinalMessage: c.ContinueFinalMessage,
		TemplateKwargs:       c.TemplateKwargs,
	}
}

// InputError reports a body that cannot be converted. Field names the part
// of the body at fault, as a path ("input[3].call_id", "messages[0].content[2].type").
type InputError struct {
	Field  string
	Reason string
	// Unsupported is set when vLLM accepts the body but derives something the
	// router cannot know (a tool-call id made from the clock, Python's repr of
	// a value...): route by load. Otherwise vLLM refuses the body too.
	Unsupported bool
}

func (e *InputError) Error() string {
	if e.Unsupported {
		return "chatconv: " + e.Field + ": cannot be reproduced: " + e.Reason
	}
	return "chatconv: invalid " + e.Field + ": " + e.Reason
}

func invalid(field, format string, args ...any) error {
	return &InputError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

func unsupported(field, format string, args ...any) error {
	return &InputError{Field: field, Reason: fmt.Sprintf(format, args...), Unsupported: true}
}

// checkBody applies the size and depth limits and parses the top object.
func checkBody(body []byte) (*object, error) {
	if len(body) > MaxBodyBytes {
		return nil, invalid("body", "larger than %d bytes", MaxBodyBytes)
	}
	if !jsonscan.DepthWithin(body, MaxDepth) {
		return nil, invalid("body", "nested deeper than %d levels", MaxDepth)
	}
	// Valid JSON first: the parsers below only read its shape, and every raw
	// value they return is then valid JSON to pass on.
	if !json.Valid(body) {
		return nil, invalid("body", "not valid JSON")
	}
	top, err := parseObject(body)
	if err != nil {
		return nil, invalid("body", "%v", err)
	}
	return top, nil
}

// object is a JSON object that keeps its keys in order, as the Python dicts
// vLLM builds do: setting a present key keeps its place.
type object struct {
	keys []string
	vals []any // json.RawMessage, string, bool, []json.RawMessage or *object
	// at indexes keys once there are many, so that a body of a million keys
	// costs no more than its length.
	at map[string]int
}

// indexFrom is the key count from which lookups go through the map.
const indexFrom = 16

func (o *object) set(key string, v any) {
	if i := o.find(key); i >= 0 {
		o.vals[i] = v
		return
	}
	o.keys = append(o.keys, key)
	o.vals = append(o.vals, v)
	switch n := len(o.keys); {
	case n > indexFrom:
		o.at[key] = n - 1
	case n == indexFrom:
		o.at = make(map[string]int, 2*indexFrom)
		for i, k := range o.keys {
			o.at[k] = i
		}
	}
}

func (o *object) find(key string) int {
	if o.at != nil {
		if i, ok := o.at[key]; ok {
			return i
		}
		return -1
	}
	for i, k := range o.keys {
		if k == key {
			return i
		}
	}
	return -1
}

func (o *object) get(key string) (any, bool) {
	if i := o.find(key); i >= 0 {
		return o.vals[i], true
	}
	return nil, false
}

// raw returns key's value as sent, nil when absent or JSON null, for an
// object parsed from the body.
func (o *object) raw(key string) json.RawMessage {
	v, _ := o.get(key)
	r, _ := v.(json.RawMessage)
	if isNull(r) {
		return nil
	}
	return r
}

// appendJSON appends o compactly, strings unescaped for HTML as Python's
// json.dumps leaves them.
func (o *object) appendJSON(dst []byte) []byte {
	dst = append(dst, '{')
	for i, k := range o.keys {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = appendString(dst, k)
		dst = append(dst, ':')
		dst = appendValue(dst, o.vals[i])
	}
	return append(dst, '}')
}

func appendValue(dst []byte, v any) []byte {
	switch v := v.(type) {
	case json.RawMessage:
		return append(dst, v...)
	case string:
		return appendString(dst, v)
	case bool:
		if v {
			return append(dst, "true"...)
		}
		return append(dst, "false"...)
	case []json.RawMessage:
		dst = append(dst, '[')
		for i, r := range v {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = append(dst, r...)
		}
		return append(dst, ']')
	case *object:
		return v.appendJSON(dst)
	case []*object:
		return appendObjects(dst, v)
	}
	return append(dst, "null"...)
}

func appendObjects(dst []byte, list []*object) []byte {
	dst = append(dst, '[')
	for i, o := range list {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = o.appendJSON(dst)
	}
	return append(dst, ']')
}

// appendString appends s as a JSON string without HTML escaping.
func appendString(dst []byte, s string) []byte {
	plain := true
	for i := 0; i < len(s) && plain; i++ {
		c := s[i]
		plain = c >= 0x20 && c != '"' && c != '\\'
	}
	if plain && utf8.ValidString(s) {
		dst = append(dst, '"')
		dst = append(dst, s...)
		return append(dst, '"')
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // a string always encodes
	return append(dst, bytes.TrimSuffix(buf.Bytes(), []byte{'\n'})...)
}

// parseObject splits a JSON object into its keys and raw values, in order.
// raw must be valid JSON (a part of a body checkBody accepted): only its
// shape is read here.
func parseObject(raw []byte) (*object, error) {
	i := skipSpace(raw, 0)
	if i == len(raw) || raw[i] != '{' {
		return nil, errors.New("not a JSON object")
	}
	// Request objects have a handful of keys: room for them at once.
	o := &object{keys: make([]string, 0, 8), vals: make([]any, 0, 8)}
	for i = skipSpace(raw, i+1); raw[i] != '}'; {
		end := jsonscan.StringEnd(raw, i+1)
		key := string(raw[i+1 : end-1])
		if strings.IndexByte(key, '\\') >= 0 {
			if err := json.Unmarshal(raw[i:end], &key); err != nil {
				return nil, err
			}
		}
		i = skipSpace(raw, skipSpace(raw, end)+1) // past the colon
		vEnd := jsonscan.ValueEnd(raw, i)
		o.set(key, json.RawMessage(raw[i:vEnd]))
		if i = skipSpace(raw, vEnd); raw[i] == ',' {
			i = skipSpace(raw, i+1)
		}
	}
	return o, nil
}

// parseArray splits a JSON array into its raw elements; raw must be valid
// JSON, as for parseObject.
func parseArray(raw []byte) ([]json.RawMessage, bool) {
	i := skipSpace(raw, 0)
	if i == len(raw) || raw[i] != '[' {
		return nil, false
	}
	items := []json.RawMessage{}
	for i = skipSpace(raw, i+1); raw[i] != ']'; {
		end := jsonscan.ValueEnd(raw, i)
		items = append(items, raw[i:end])
		if i = skipSpace(raw, end); raw[i] == ',' {
			i = skipSpace(raw, i+1)
		}
	}
	return items, true
}

// skipSpace returns the index of the first byte at or after i that is not
// JSON whitespace.
func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// stringValue decodes r when it is a JSON string (of a valid body).
func stringValue(r json.RawMessage) (string, bool) {
	if len(r) < 2 || r[0] != '"' {
		return "", false
	}
	if inner := r[1 : len(r)-1]; bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		return string(inner), true
	}
	var s string
	return s, json.Unmarshal(r, &s) == nil
}

func isNull(r json.RawMessage) bool {
	return len(r) == 0 || string(r) == "null"
}

// str decodes an optional string field: absent and null give ok=false.
func str(o *object, key, field string) (s string, ok bool, err error) {
	r := o.raw(key)
	if r == nil {
		return "", false, nil
	}
	s, isString := stringValue(r)
	if !isString {
		return "", false, invalid(field, "must be a string")
	}
	return s, true, nil
}

// boolean decodes an optional boolean field; absent and null give def.
func boolean(o *object, key, field string, def bool) (bool, error) {
	switch r := o.raw(key); string(r) {
	case "":
		return def, nil
	case "true":
		return true, nil
	case "false":
		return false, nil
	}
	return false, invalid(field, "must be a boolean")
}

// integer decodes an optional integer field; absent and null give -1.
func integer(o *object, key, field string) (int, error) {
	r := o.raw(key)
	if r == nil {
		return -1, nil
	}
	var n int
	if json.Unmarshal(r, &n) != nil {
		return 0, invalid(field, "must be an integer")
	}
	return n, nil
}

// child parses an optional object field; absent and null give nil.
func child(o *object, key, field string) (*object, error) {
	r := o.raw(key)
	if r == nil {
		return nil, nil
	}
	c, err := parseObject(r)
	if err != nil {
		return nil, invalid(field, "must be an object")
	}
	return c, nil
}

func index(field string, i int) string { return fmt.Sprintf("%s[%d]", field, i) }
