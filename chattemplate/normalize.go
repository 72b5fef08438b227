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
