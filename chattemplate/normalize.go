package chattemplate

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/ardanlabs/jinja"
)

// normalizeToolCalls applies what vLLM does to assistant tool calls before
// rendering (chat_utils._postprocess_messages): OpenAI clients send
// function.arguments as a JSON string, but chat templates expect a mapping,
// so vLLM parses it — invalid JSON, non-objects, null and "" all become {} —
// and drops an empty tool_calls list. Without this, every tool-using
// conversation from an OpenAI SDK would render differently from the engine.
//
// Values may be shared with the decode cache, so a changed message is
// copied, never modified.
func normalizeToolCalls(m jinja.Value) (jinja.Value, error) {
	msg := m.AsDict()
	role, _ := msg.Get("role")
	calls, ok := msg.Get("tool_calls")
	if !ok || !role.IsString() || role.AsString() != "assistant" || !calls.IsList() {
		return m, nil
	}
	if calls.AsList().Len() == 0 {
		return dictWithout(msg, "tool_calls"), nil
	}
	var newCalls []jinja.Value // nil until a call changes
	for j, item := range calls.AsList().Items {
		if !item.IsDict() {
			return jinja.Undefined(), &InputError{Field: "messages", Reason: "assistant tool_calls entries must be objects"}
		}
		call := item.AsDict()
		typ, hasType := call.Get("type")
		fn, _ := call.Get("function")
		if (hasType && !(typ.IsString() && typ.AsString() == "function")) || !fn.IsDict() {
			return jinja.Undefined(), &InputError{Field: "messages", Reason: "chat completions only support assistant tool_calls of type 'function'"}
		}
		args, _ := fn.AsDict().Get("arguments")
		parsed, changed := normalizeArguments(args)
		if !changed {
			continue
		}
		if newCalls == nil {
			newCalls = append([]jinja.Value(nil), calls.AsList().Items...)
		}
		newCalls[j] = dictWith(call, "function", dictWith(fn.AsDict(), "arguments", parsed))
	}
	if newCalls != nil {
		return dictWith(msg, "tool_calls", jinja.NewList(newCalls)), nil
	}
	return m, nil
}

// normalizeArguments is vLLM's rule for function.arguments: a non-empty
// mapping stays; a string is parsed as JSON and kept if it is an object;
// anything else becomes {}.
func normalizeArguments(args jinja.Value) (jinja.Value, bool) {
	if args.IsDict() && args.AsDict().Len() > 0 {
		return args, false
	}
	if args.IsString() && args.AsString() != "" {
		if v, err := decodeJSON(args.AsString()); err == nil && v.IsDict() {
			return v, true
		}
	}
	if args.IsDict() {
		return args, false // {} stays {}
	}
	return jinja.NewDict(), true
}

// dictWith returns a copy of d with key set to v (appended if new).
func dictWith(d *jinja.Dict, key string, v jinja.Value) jinja.Value {
	out := jinja.NewDict()
	od := out.AsDict()
	for _, k := range d.Keys {
		val, _ := d.Get(k)
		od.Set(k, val)
	}
	od.Set(key, v)
	return out
}

// dictWithout returns a copy of d without key.
func dictWithout(d *jinja.Dict, key string) jinja.Value {
	out := jinja.NewDict()
	od := out.AsDict()
	for _, k := range d.Keys {
		if k != key {
			val, _ := d.Get(k)
			od.Set(k, val)
		}
	}
	return out
}

// normalizeTools returns the tools as vLLM hands them to the template: each
// one validated as ChatCompletionToolsParam and model_dump()ed, so declared
// fields come first in declaration order — type ("function" when absent),
// then function with name, description and parameters (None when absent) —
// followed by any extra fields in request order. Templates print tools with
// tojson, so this order and those nulls are part of the prompt.
func normalizeTools(tools *jinja.List) (jinja.Value, error) {
	out := make([]jinja.Value, len(tools.Items))
	for i, tv := range tools.Items {
		if !tv.IsDict() {
			return jinja.Undefined(), &InputError{Field: "tools", Reason: "each tool must be an object"}
		}
		tool := tv.AsDict()
		if typ, ok := tool.Get("type"); ok && !(typ.IsString() && typ.AsString() == "function") {
			return jinja.Undefined(), &InputError{Field: "tools", Reason: `tool "type" must be "function"`}
		}
		fv, ok := tool.Get("function")
		if !ok || !fv.IsDict() {
			return jinja.Undefined(), &InputError{Field: "tools", Reason: `each tool needs a "function" object`}
		}
		fn := fv.AsDict()
		name, ok := fn.Get("name")
		if !ok || !name.IsString() {
			return jinja.Undefined(), &InputError{Field: "tools", Reason: `function "name" must be a string`}
		}
		desc, ok := fn.Get("description")
		if !ok {
			desc = jinja.None()
		} else if !desc.IsString() && !desc.IsNone() {
			return jinja.Undefined(), &InputError{Field: "tools", Reason: `function "description" must be a string or null`}
		}
		params, ok := fn.Get("parameters")
		if !ok {
			params = jinja.None()
		} else if !params.IsDict() && !params.IsNone() {
			return jinja.Undefined(), &InputError{Field: "tools", Reason: `function "parameters" must be an object or null`}
		}
		nf := jinja.NewDict()
		nfd := nf.AsDict()
		nfd.Set("name", name)
		nfd.Set("description", desc)
		nfd.Set("parameters", params)
		copyExtra(nfd, fn, "name", "description", "parameters")

		nt := jinja.NewDict()
		ntd := nt.AsDict()
		ntd.Set("type", jinja.NewString("function"))
		ntd.Set("function", nf)
		copyExtra(ntd, tool, "type", "function")
		out[i] = nt
	}
	return jinja.NewList(out), nil
}

// copyExtra appends src's keys other than declared to dst, in src's order.
func copyExtra(dst, src *jinja.Dict, declared ...string) {
next:
	for _, k := range src.Keys {
		for _, d := range declared {
			if k == d {
				continue next
			}
		}
		v, _ := src.Get(k)
		dst.Set(k, v)
	}
}

// contentLoop matches a template loop over a message's content, which is
// how vLLM decides a template takes OpenAI-style content parts (its
// "openai" content format) rather than one string.
var contentLoop = regexp.MustCompile(`\bfor\s+\w+\s+in\s+(\w+\s*(\.\s*content\b|\[\s*['"]content['"]\s*\])|content\b)`)

// FirstMediaMessage returns the index of the first message in the JSON
// messages array that holds a content part vLLM does not treat as text (an
// image, audio, a video...), for callers that hand chats to something else
// to tokenize. Malformed input reports none: rendering reports it.
func FirstMediaMessage(messages []byte) (int, bool) {
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(messages, &msgs) != nil {
		return 0, false
	}
	for i, m := range msgs {
		var parts []json.RawMessage
		if json.Unmarshal(m.Content, &parts) != nil {
			continue // a string, null, or not content at all
		}
		for _, p := range parts {
			var part struct {
				Type string `json:"type"`
			}
			if json.Unmarshal(p, &part) != nil {
				continue // a string part, or malformed
			}
			if _, text := textPartKeys[part.Type]; !text {
				return i, true
			}
		}
	}
	return 0, false
}

// textPartKeys maps the content-part types vLLM treats as text to the key
// holding their text.
var textPartKeys = map[string]string{
	"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking",
}

// vllmMessage rebuilds a message as vLLM's parse_chat_messages does
// before rendering (chat_utils._parse_chat_message_content): only role,
// content and the fields vLLM copies survive (assistant tool_calls and
// reasoning, tool tool_call_id, string name and task, developer tools);
// content null becomes "", and content parts are joined with "\n" into one
// string — or, for templates that loop over content (openaiParts), every
// content becomes a list of {"type": "text", "text": ...} parts. Media parts
// are an InputError with Media set: the router cannot render them.
func vllmMessage(src *jinja.Dict, openaiParts bool) (jinja.Value, error) {
	role, _ := src.Get("role")
	content, err := vllmContent(src, openaiParts, role.AsString() == "tool")
	if err != nil {
		return jinja.Undefined(), err
	}
	out := jinja.NewDict()
	od := out.AsDict()
	od.Set("role", role)
	od.Set("content", content)
	switch role.AsString() {
	case "assistant":
		if tc, ok := src.Get("tool_calls"); ok && !tc.IsNone() {
			if !tc.IsList() {
				return jinja.Undefined(), &InputError{Field: "messages", Reason: "assistant tool_calls must be an array"}
			}
			od.Set("tool_calls", tc)
		}
		if r, ok := src.Get("reasoning"); ok && !r.IsNone() {
			od.Set("reasoning", r)
			od.Set("reasoning_content", r)
		}
	case "tool":
		if id, ok := src.Get("tool_call_id"); ok {
			od.Set("tool_call_id", id)
		}
	}
	for _, k := range []string{"name", "task"} {
		if v, ok := src.Get(k); ok && v.IsString() {
			od.Set(k, v)
		}
	}
	if role.AsString() == "developer" {
		tools, ok := src.Get("tools")
		if !ok {
			tools = jinja.None()
		}
		od.Set("tools", tools)
	}
	return out, nil
}

// prepareMessage turns one decoded request message into what vLLM hands
// the template: validated, rebuilt (vllmMessage), tool calls normalised.
// It is pure, so its result is what the decode cache keeps.
func prepareMessage(m jinja.Value, i int, openaiParts bool) (jinja.Value, error) {
	if !m.IsDict() {
		return jinja.Undefined(), &InputError{Field: "messages", Reason: fmt.Sprintf("message %d is not a JSON object", i)}
	}
	role, ok := m.AsDict().Get("role")
	if !ok || !role.IsString() {
		return jinja.Undefined(), &InputError{Field: "messages", Reason: fmt.Sprintf("message %d has no string \"role\"", i)}
	}
	m, err := vllmMessage(m.AsDict(), openaiParts)
	if err != nil {
		var ie *InputError
		if errors.As(err, &ie) && ie.Media {
			ie.Message = i
		}
		return jinja.Undefined(), err
	}
	return normalizeToolCalls(m)
}

// vllmContent converts one message's content as vLLM does.
func vllmContent(msg *jinja.Dict, openaiParts, isTool bool) (jinja.Value, error) {
	c, _ := msg.Get("content")
	var parts []jinja.Value
	switch {
	case c.IsNone() || c.IsUndefined():
	case c.IsString():
		parts = []jinja.Value{c}
	case c.IsList():
		parts = c.AsList().Items
	default:
		return jinja.Undefined(), &InputError{Field: "messages", Reason: "message content must be a string, an array of parts or null"}
	}
	var texts []string
	for _, p := range parts {
		if p.IsString() {
			texts = append(texts, p.AsString())
			continue
		}
		if !p.IsDict() {
			return jinja.Undefined(), &InputError{Field: "messages", Reason: "content parts must be strings or objects"}
		}
		typ, _ := p.AsDict().Get("type")
		if !typ.IsString() {
			return jinja.Undefined(), &InputError{Field: "messages", Reason: `content part without a string "type"`}
		}
		key, isText := textPartKeys[typ.AsString()]
		if !isText {
			return jinja.Undefined(), &InputError{Field: "messages", Reason: fmt.Sprintf("content part type %q is not supported for text models", typ.AsString()), Media: true}
		}
		t, ok := p.AsDict().Get(key)
		if !ok || t.IsNone() {
			if typ.AsString() == "text" || typ.AsString() == "refusal" {
				continue // vLLM skips text parts without text
			}
			return jinja.Undefined(), &InputError{Field: "messages", Reason: fmt.Sprintf("content part %q has no text", typ.AsString())}
		}
		texts = append(texts, pyStr(t))
	}
	if !openaiParts || isTool {
		// vLLM joins text parts; in the "openai" format it does so for tool
		// messages whose parts are all text.
		return jinja.NewString(strings.Join(texts, "\n")), nil
	}
	items := make([]jinja.Value, len(texts))
	for i, t := range texts {
		d := jinja.NewDict()
		d.AsDict().Set("type", jinja.NewString("text"))
		d.AsDict().Set("text", jinja.NewString(t))
		items[i] = d
	}
	return jinja.NewList(items), nil
}
