package chattemplate

import "github.com/ardanlabs/jinja"

// normalizeToolCalls applies what vLLM does to assistant tool calls before
// rendering (chat_utils._postprocess_messages): OpenAI clients send
// function.arguments as a JSON string, but chat templates expect a mapping,
// so vLLM parses it — invalid JSON, non-objects, null and "" all become {} —
// and drops an empty tool_calls list. Without this, every tool-using
// conversation from an OpenAI SDK would render differently from the engine.
//
// Messages may be shared with the decode cache, so changed messages are
// copied, never modified.
func normalizeToolCalls(messages *jinja.List) error {
	for i, m := range messages.Items {
		msg := m.AsDict()
		role, _ := msg.Get("role")
		calls, ok := msg.Get("tool_calls")
		if !ok || !role.IsString() || role.AsString() != "assistant" || !calls.IsList() {
			continue
		}
		if calls.AsList().Len() == 0 {
			messages.Items[i] = dictWithout(msg, "tool_calls")
			continue
		}
		var newCalls []jinja.Value // nil until a call changes
		for j, item := range calls.AsList().Items {
			if !item.IsDict() {
				return &InputError{Field: "messages", Reason: "assistant tool_calls entries must be objects"}
			}
			call := item.AsDict()
			typ, hasType := call.Get("type")
			fn, _ := call.Get("function")
			if (hasType && !(typ.IsString() && typ.AsString() == "function")) || !fn.IsDict() {
				return &InputError{Field: "messages", Reason: "chat completions only support assistant tool_calls of type 'function'"}
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
			messages.Items[i] = dictWith(msg, "tool_calls", jinja.NewList(newCalls))
		}
	}
	return nil
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
