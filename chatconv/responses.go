package chatconv

import (
	"encoding/json"
)

// FromResponses converts a /v1/responses body as vLLM's chat-template path
// does (construct_input_messages, construct_tool_dicts, build_chat_params):
//
//   - non-empty instructions become a leading system message;
//   - a string input is one user message;
//   - message items with role user, system or developer keep their role and
//     content (a string or parts: input_text parts render as text, others
//     such as input_image are media chattemplate reports);
//   - assistant messages (output messages included) keep the text of their
//     first content part only, as vLLM does;
//   - function_call items become assistant tool_calls (arguments kept as the
//     string sent; a namespace prefixes the name with "namespace__") and
//     function_call_output items tool messages;
//   - reasoning items become an assistant message's "reasoning": the text of
//     the first content part, else of the first summary part;
//   - consecutive assistant items merge as vLLM merges them: a function call
//     joins the previous assistant message's tool_calls, a reasoning item or
//     an output message fills that message's reasoning or content when it
//     has none yet;
//   - function tools (and the functions of namespace tools) become
//     chat-completions tools laid out as vLLM's model_dump() does; built-in
//     tools (web search, MCP...) are not template tools;
//   - chat_template_kwargs (a vLLM extension) are kept, reasoning.effort
//     becomes the template's reasoning_effort over them, and a last message
//     or reasoning item with status in_progress or incomplete is continued
//     instead of opening a new assistant turn.
//
// Not reproduced: vLLM's own stored state (see Chat.PreviousResponseID),
// server-side default chat_template_kwargs, and gpt-oss models, which vLLM
// renders with Harmony instead of a chat template.
func FromResponses(body []byte) (Chat, error) {
	top, err := checkBody(body)
	if err != nil {
		return Chat{}, err
	}
	c := Chat{AddGenerationPrompt: true}
	if c.Model, _, err = str(top, "model", "model"); err != nil {
		return Chat{}, err
	}
	if top.raw("prompt") != nil {
		return Chat{}, invalid("prompt", "prompt templates are not supported")
	}
	if c.Stream, err = boolean(top, "stream", "stream", false); err != nil {
		return Chat{}, err
	}
	// store defaults to true; an explicit null is None, which is false.
	if v, ok := top.get("store"); ok && isNull(v.(json.RawMessage)) {
		c.Store = false
	} else if c.Store, err = boolean(top, "store", "store", true); err != nil {
		return Chat{}, err
	}
	if c.MaxOutputTokens, err = integer(top, "max_output_tokens", "max_output_tokens"); err != nil {
		return Chat{}, err
	}
	if c.PreviousResponseID, _, err = str(top, "previous_response_id", "previous_response_id"); err != nil {
		return Chat{}, err
	}
	instructions, _, err := str(top, "instructions", "instructions")
	if err != nil {
		return Chat{}, err
	}
	var msgs []*object
	if instructions != "" {
		msgs = append(msgs, message("system", instructions))
	}
	input := top.raw("input")
	switch {
	case input == nil:
		return Chat{}, invalid("input", "is required")
	case input[0] == '"':
		s, isString := stringValue(input)
		if !isString {
			return Chat{}, invalid("input", "must be a string or an array of items")
		}
		msgs = append(msgs, message("user", s))
	default:
		items, ok := parseArray(input)
		if !ok {
			return Chat{}, invalid("input", "must be a string or an array of items")
		}
		if msgs, err = appendItems(msgs, items); err != nil {
			return Chat{}, err
		}
		if c.ContinueFinalMessage, err = continuesFinal(items); err != nil {
			return Chat{}, err
		}
		c.AddGenerationPrompt = !c.ContinueFinalMessage
	}
	c.Messages = appendObjects(nil, msgs)
	if c.Tools, err = responsesTools(top.raw("tools")); err != nil {
		return Chat{}, err
	}
	if c.ToolChoice, err = responsesToolChoice(top.raw("tool_choice")); err != nil {
		return Chat{}, err
	}
	kw, err := requestKwargs(top)
	if err != nil {
		return Chat{}, err
	}
	reasoning, err := child(top, "reasoning", "reasoning")
	if err != nil {
		return Chat{}, err
	}
	if reasoning != nil {
		effort, ok, err := str(reasoning, "effort", "reasoning.effort")
		if err != nil {
			return Chat{}, err
		}
		if ok {
			kw.set("reasoning_effort", effort)
		}
	}
	c.TemplateKwargs = kwargsJSON(kw)
	return c, nil
}

func message(role string, content any) *object {
	m := &object{}
	m.set("role", role)
	m.set("content", content)
	return m
}

// appendItems converts the input items in order, merging into the previous
// assistant message where vLLM does (_construct_message_from_response_item).
func appendItems(msgs []*object, items []json.RawMessage) ([]*object, error) {
	for i, raw := range items {
		field := index("input", i)
		item, err := parseObject(raw)
		if err != nil {
			return nil, invalid(field, "must be an object")
		}
		var prev *object // the previous message, when it is the assistant's
		if n := len(msgs); n > 0 {
			if role, _ := msgs[n-1].get("role"); role == "assistant" {
				prev = msgs[n-1]
			}
		}
		typ, _, err := str(item, "type", field+".type")
		if err != nil {
			return nil, err
		}
		role, hasRole, err := str(item, "role", field+".role")
		if err != nil {
			return nil, err
		}
		var m *object
		switch {
		case typ == "function_call":
			m, err = functionCall(item, field, prev)
		case typ == "reasoning":
			m, err = reasoningItem(item, field, prev)
		case typ == "function_call_output":
			m, err = functionCallOutput(item, field)
		case hasRole && role == "assistant" && (typ == "" || typ == "message"):
			m, err = assistantItem(item, field, prev)
		case hasRole && (typ == "" || typ == "message"):
			m, err = inputMessage(item, field, role)
		case typ == "":
			return nil, invalid(field, `needs a "type" or a "role"`)
		default:
			// item_reference, hosted tool calls...: vLLM passes them on as
			// they are and its chat parser refuses a message without a role.
			return nil, invalid(field+".type", "%q items are not supported", typ)
		}
		if err != nil {
			return nil, err
		}
		if m != nil {
			msgs = append(msgs, m)
		}
	}
	return msgs, nil
}

// functionCall is vLLM's ResponseFunctionToolCall branch: the body's
// function_call_parsing validator makes a model of every well-formed call.
func functionCall(item *object, field string, prev *object) (*object, error) {
	var f [3]string
	for i, k := range []string{"call_id", "name", "arguments"} {
		s, ok, err := str(item, k, field+"."+k)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, invalid(field+"."+k, "is required")
		}
		f[i] = s
	}
	ns, _, err := str(item, "namespace", field+".namespace")
	if err != nil {
		return nil, err
	}
	name := f[1]
	if ns != "" {
		name = ns + "__" + name
	}
	fn := &object{}
	fn.set("name", name)
	fn.set("arguments", f[2])
	call := &object{}
	call.set("id", f[0])
	call.set("function", fn)
	call.set("type", "function")
	callJSON := json.RawMessage(call.appendJSON(nil))
	if prev != nil {
		calls, _ := prev.get("tool_calls")
		list, _ := calls.([]json.RawMessage)
		prev.set("tool_calls", append(list, callJSON))
		return nil, nil
	}
	m := &object{}
	m.set("role", "assistant")
	m.set("tool_calls", []json.RawMessage{callJSON})
	return m, nil
}

// reasoningItem is vLLM's reasoning branch: the text of the first content
// part, else of the first summary part, else "".
func reasoningItem(item *object, field string, prev *object) (*object, error) {
	if enc, _, _ := str(item, "encrypted_content", field+".encrypted_content"); enc != "" {
		// vLLM's ResponseReasoningItem branch refuses it; its dict branch,
		// which older vLLM took, ignores it.
		return nil, unsupported(field+".encrypted_content", "vLLM refuses or ignores encrypted reasoning by version")
	}
	text := ""
	for _, k := range []string{"content", "summary"} {
		r := item.raw(k)
		if r == nil {
			continue
		}
		parts, ok := parseArray(r)
		if !ok {
			return nil, invalid(field+"."+k, "must be an array")
		}
		if len(parts) == 0 {
			continue
		}
		t, err := partText(parts[0], field+"."+k+"[0]")
		if err != nil {
			return nil, err
		}
		text = t
		break
	}
	if prev != nil {
		if _, has := prev.get("reasoning"); !has {
			prev.set("reasoning", text)
			return nil, nil
		}
	}
	m := &object{}
	m.set("role", "assistant")
	m.set("reasoning", text)
	return m, nil
}

// partText is vLLM's `part.get("text", "")` for an object part, or the part
// itself when it is a string.
func partText(raw json.RawMessage, field string) (string, error) {
	if len(raw) > 0 && raw[0] == '"' {
		s, isString := stringValue(raw)
		if !isString {
			return "", invalid(field, "must be a string or an object")
		}
		return s, nil
	}
	p, err := parseObject(raw)
	if err != nil {
		return "", invalid(field, "must be a string or an object")
	}
	if v, present := p.get("text"); present && isNull(v.(json.RawMessage)) {
		return "", unsupported(field+".text", "null text is None in vLLM's message")
	}
	s, _, err := str(p, "text", field+".text")
	return s, err
}

// assistantItem is vLLM's assistant-message branch (output messages and
// dict-form assistant messages alike): only the first part's text is kept.
func assistantItem(item *object, field string, prev *object) (*object, error) {
	text := ""
	if r := item.raw("content"); r != nil {
		if r[0] == '"' {
			var isString bool
			if text, isString = stringValue(r); !isString {
				return nil, invalid(field+".content", "must be a string or an array of parts")
			}
		} else {
			parts, ok := parseArray(r)
			if !ok {
				return nil, invalid(field+".content", "must be a string or an array of parts")
			}
			if len(parts) > 0 {
				t, err := partText(parts[0], field+".content[0]")
				if err != nil {
					return nil, err
				}
				text = t
			}
		}
	}
	if prev != nil {
		if _, has := prev.get("content"); !has {
			prev.set("content", text)
			return nil, nil
		}
	}
	return message("assistant", text), nil
}

// inputMessage is a user, system or developer message, which vLLM passes on
// as validated (role and content).
func inputMessage(item *object, field, role string) (*object, error) {
	switch role {
	case "user", "system", "developer":
	default:
		return nil, invalid(field+".role", "%q is not a message role", role)
	}
	content := item.raw("content")
	if content == nil || (content[0] != '"' && content[0] != '[') {
		return nil, invalid(field+".content", "must be a string or an array of parts")
	}
	return message(role, content), nil
}

// functionCallOutput becomes a tool message; the output (a string or parts)
// is kept as sent.
func functionCallOutput(item *object, field string) (*object, error) {
	callID, ok, err := str(item, "call_id", field+".call_id")
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, invalid(field+".call_id", "is required")
	}
	output := item.raw("output")
	if output == nil || (output[0] != '"' && output[0] != '[') {
		return nil, invalid(field+".output", "must be a string or an array of parts")
	}
	m := message("tool", output)
	m.set("tool_call_id", callID)
	return m, nil
}

// continuesFinal is vLLM's should_continue_final_message: the last item is
// a message or reasoning item (type defaulting to "message") whose status
// says it is unfinished.
func continuesFinal(items []json.RawMessage) (bool, error) {
	if len(items) == 0 {
		return false, nil
	}
	field := index("input", len(items)-1)
	last, err := parseObject(items[len(items)-1])
	if err != nil {
		return false, invalid(field, "must be an object")
	}
	typ, ok, _ := str(last, "type", field+".type")
	if !ok {
		typ = "message"
	}
	if typ != "message" && typ != "reasoning" {
		return false, nil
	}
	status, _, _ := str(last, "status", field+".status")
	return status == "in_progress" || status == "incomplete", nil
}

// responsesTools converts the function tools (construct_tool_dicts): nil
// when the request has no tools, an empty array when none is a function.
func responsesTools(raw json.RawMessage) (json.RawMessage, error) {
	if raw == nil {
		return nil, nil
	}
	tools, ok := parseArray(raw)
	if !ok {
		return nil, invalid("tools", "must be an array")
	}
	if len(tools) == 0 {
		return nil, nil
	}
	out := []*object{}
	for i, r := range tools {
		field := index("tools", i)
		tool, err := parseObject(r)
		if err != nil {
			return nil, invalid(field, "must be an object")
		}
		typ, _, err := str(tool, "type", field+".type")
		if err != nil {
			return nil, err
		}
		switch typ {
		case "function":
			t, err := functionTool(tool, field, "")
			if err != nil {
				return nil, err
			}
			out = append(out, t)
		case "namespace":
			ns, ok, err := str(tool, "name", field+".name")
			if err != nil {
				return nil, err
			}
			if !ok {
				return nil, invalid(field+".name", "is required")
			}
			inner, ok := parseArray(tool.raw("tools"))
			if !ok {
				return nil, invalid(field+".tools", "must be an array")
			}
			for j, ir := range inner {
				f := index(field+".tools", j)
				it, err := parseObject(ir)
				if err != nil {
					return nil, invalid(f, "must be an object")
				}
				if t, _, _ := str(it, "type", f+".type"); t != "function" {
					continue
				}
				t, err := functionTool(it, f, ns)
				if err != nil {
					return nil, err
				}
				out = append(out, t)
			}
		case "":
			return nil, invalid(field+".type", "is required")
		}
	}
	return appendObjects(nil, out), nil
}

// functionTool lays a Responses function tool out as vLLM does:
// FunctionTool.model_dump() (declared fields name, parameters, strict,
// description with their nulls, then extra keys), "type" dropped, validated
// as vLLM's FunctionDefinition (name, description, parameters, defer_loading
// when not null, then the rest in order) inside a ChatCompletionToolsParam.
func functionTool(tool *object, field, namespace string) (*object, error) {
	name, ok, err := str(tool, "name", field+".name")
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, invalid(field+".name", "is required")
	}
	if namespace != "" {
		name = namespace + "__" + name
	}
	fn := &object{}
	fn.set("name", name)
	fn.set("description", nullable(tool.raw("description")))
	fn.set("parameters", nullable(tool.raw("parameters")))
	if d := tool.raw("defer_loading"); d != nil {
		fn.set("defer_loading", d)
	}
	fn.set("strict", nullable(tool.raw("strict")))
	for i, k := range tool.keys {
		switch k {
		case "name", "description", "parameters", "defer_loading", "strict", "type":
			continue
		}
		fn.set(k, tool.vals[i])
	}
	if err := checkKinds(fn, field); err != nil {
		return nil, err
	}
	t := &object{}
	t.set("type", "function")
	t.set("function", fn)
	return t, nil
}

// checkKinds checks the declared function fields' JSON kinds as pydantic
// validates them.
func checkKinds(fn *object, field string) error {
	for _, w := range []struct {
		key  string
		kind byte
	}{{"description", '"'}, {"parameters", '{'}, {"defer_loading", 't'}, {"strict", 't'}} {
		k, kind := w.key, w.kind
		v, ok := fn.get(k)
		if !ok {
			continue
		}
		r := v.(json.RawMessage)
		if isNull(r) {
			continue
		}
		got := r[0]
		if got == 'f' {
			got = 't'
		}
		if got != kind {
			return invalid(field+"."+k, "has the wrong JSON type")
		}
	}
	return nil
}

func nullable(r json.RawMessage) json.RawMessage {
	if r == nil {
		return json.RawMessage("null")
	}
	return r
}

// responsesToolChoice maps a Responses tool_choice onto the chat shape:
// the modes stay, {"type":"function","name":n} names the function; others
// (allowed_tools, hosted tools) are kept as sent.
func responsesToolChoice(raw json.RawMessage) (json.RawMessage, error) {
	if raw == nil || raw[0] == '"' {
		return raw, nil
	}
	o, err := parseObject(raw)
	if err != nil {
		return nil, invalid("tool_choice", "must be a string or an object")
	}
	if t, _, _ := str(o, "type", "tool_choice.type"); t != "function" {
		return raw, nil
	}
	name, _, err := str(o, "name", "tool_choice.name")
	if err != nil {
		return nil, err
	}
	return namedChoice(name), nil
}

// namedChoice is a chat-completions tool_choice naming one function.
func namedChoice(name string) json.RawMessage {
	fn := &object{}
	fn.set("name", name)
	tc := &object{}
	tc.set("type", "function")
	tc.set("function", fn)
	return tc.appendJSON(nil)
}
