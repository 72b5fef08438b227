package chatconv

import (
	"encoding/json"
	"strings"
)

// FromMessages converts a /v1/messages body into the chat-completions
// request vLLM's Anthropic handler builds (_convert_anthropic_to_openai_request)
// and renders through its chat serving:
//
//   - the system string, the text of system blocks and of messages with role
//     "system" are joined, without separator, into one leading system
//     message; blocks starting with "x-anthropic-billing-header" (Claude
//     Code's per-request attribution) are dropped, as vLLM drops them;
//   - roles "ctx" and "msg" are "user", as vLLM maps them;
//   - non-empty text blocks become text parts (one text part alone becomes the
//     content string), image blocks image_url parts (media, which
//     chattemplate reports), thinking blocks the message's "reasoning" and
//     tool_use blocks tool_calls with arguments json.dumps(input) in Python's
//     format; redacted_thinking and tool_reference blocks are dropped;
//   - a user's tool_result block becomes a tool message placed before that
//     user message (text parts joined with "\n"; images follow in a user
//     message, tool references in a further tool message), and a user
//     message left without content is dropped;
//   - tools become function tools (input_schema as parameters, "type":
//     "object" added at its end when missing, defer_loading when set);
//     tool_choice auto/any/none/tool becomes auto/required/none/the named
//     function, and "auto" when tools come without one;
//   - chat_template_kwargs are kept, under vLLM's own arguments:
//     output_config.effort sets reasoning_effort and, unless the kwargs say,
//     enable_thinking (effort other than "none").
//
// Not reproduced (Unsupported): a tool_use block without an id (vLLM names it
// from the clock) and an assistant's tool_result with a list content (vLLM
// prints Python's repr of it). Later vLLM (anthropic/inline_system.py,
// a8c3bdb2) no longer hoists system-role messages found inside "messages":
// it keeps them in place or folds their text into a neighbouring message,
// choosing by probing the model's template at startup, which a router
// cannot see; requests without such messages convert the same either way.
func FromMessages(body []byte) (Chat, error) {
	top, err := checkBody(body)
	if err != nil {
		return Chat{}, err
	}
	c := Chat{AddGenerationPrompt: true}
	var ok bool
	if c.Model, ok, err = str(top, "model", "model"); err != nil {
		return Chat{}, err
	} else if !ok || c.Model == "" {
		return Chat{}, invalid("model", "is required")
	}
	if c.MaxOutputTokens, err = integer(top, "max_tokens", "max_tokens"); err != nil {
		return Chat{}, err
	} else if c.MaxOutputTokens <= 0 {
		return Chat{}, invalid("max_tokens", "must be a positive integer")
	}
	if c.Stream, err = boolean(top, "stream", "stream", false); err != nil {
		return Chat{}, err
	}
	items, ok := parseArray(top.raw("messages"))
	if !ok {
		return Chat{}, invalid("messages", "must be an array")
	}
	msgs := make([]anthropicMessage, len(items))
	for i, r := range items {
		if msgs[i], err = parseAnthropicMessage(r, index("messages", i)); err != nil {
			return Chat{}, err
		}
	}
	var out []*object
	system, hasSystem, err := systemText(top, msgs)
	if err != nil {
		return Chat{}, err
	}
	if hasSystem {
		out = append(out, message("system", system))
	}
	for _, m := range msgs {
		if out, err = m.appendChat(out); err != nil {
			return Chat{}, err
		}
	}
	c.Messages = appendObjects(nil, out)
	if err := anthropicTools(top, &c); err != nil {
		return Chat{}, err
	}
	if c.TemplateKwargs, err = anthropicKwargs(top); err != nil {
		return Chat{}, err
	}
	return c, nil
}

type anthropicMessage struct {
	field  string
	role   string
	text   string // content, when it is a string
	blocks []block
}

// block is an AnthropicContentBlock: the fields vLLM reads, validated.
type block struct {
	field                        string
	typ, text, id, name, toolUse string
	hasText, hasThinking         bool
	thinking                     string
	source                       *object
	input                        json.RawMessage // an object, or nil
	content                      json.RawMessage // a string, an array of objects, or nil
}

func parseAnthropicMessage(raw json.RawMessage, field string) (anthropicMessage, error) {
	m := anthropicMessage{field: field}
	o, err := parseObject(raw)
	if err != nil {
		return m, invalid(field, "must be an object")
	}
	role, _, err := str(o, "role", field+".role")
	if err != nil {
		return m, err
	}
	switch role {
	case "ctx", "msg":
		role = "user"
	case "user", "assistant", "system":
	default:
		return m, invalid(field+".role", "must be user, assistant or system")
	}
	m.role = role
	content := o.raw("content")
	if content != nil && content[0] == '"' {
		var isString bool
		if m.text, isString = stringValue(content); !isString {
			return m, invalid(field+".content", "must be a string or an array of blocks")
		}
		return m, nil
	}
	m.blocks, err = parseBlocks(content, field+".content")
	return m, err
}

func parseBlocks(raw json.RawMessage, field string) ([]block, error) {
	items, ok := parseArray(raw)
	if !ok {
		return nil, invalid(field, "must be a string or an array of blocks")
	}
	blocks := make([]block, len(items))
	for i, r := range items {
		f := index(field, i)
		o, err := parseObject(r)
		if err != nil {
			return nil, invalid(f, "must be an object")
		}
		b := block{field: f}
		if b.typ, _, err = str(o, "type", f+".type"); err != nil {
			return nil, err
		}
		switch b.typ {
		case "text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking":
		default:
			return nil, invalid(f+".type", "%q is not a content block type", b.typ)
		}
		for _, s := range []struct {
			key string
			dst *string
			has *bool
		}{{"text", &b.text, &b.hasText}, {"id", &b.id, nil}, {"name", &b.name, nil}, {"tool_use_id", &b.toolUse, nil}, {"thinking", &b.thinking, &b.hasThinking}} {
			v, ok, err := str(o, s.key, f+"."+s.key)
			if err != nil {
				return nil, err
			}
			*s.dst = v
			if s.has != nil {
				*s.has = ok
			}
		}
		if b.source, err = child(o, "source", f+".source"); err != nil {
			return nil, err
		}
		if b.input = o.raw("input"); b.input != nil && b.input[0] != '{' {
			return nil, invalid(f+".input", "must be an object")
		}
		if b.content = o.raw("content"); b.content != nil && b.content[0] != '"' {
			parts, ok := parseArray(b.content)
			if !ok {
				return nil, invalid(f+".content", "must be a string or an array of objects")
			}
			for j, p := range parts {
				if len(p) == 0 || p[0] != '{' {
					return nil, invalid(index(f+".content", j), "must be an object")
				}
			}
		}
		blocks[i] = b
	}
	return blocks, nil
}

// systemText is _convert_system_message: the top-level system, then the
// system-role messages, concatenated.
func systemText(top *object, msgs []anthropicMessage) (string, bool, error) {
	var parts []string
	if r := top.raw("system"); r != nil {
		if r[0] == '"' {
			s, isString := stringValue(r)
			if !isString {
				return "", false, invalid("system", "must be a string or an array of blocks")
			}
			if s != "" {
				parts = append(parts, s)
			}
		} else {
			blocks, err := parseBlocks(r, "system")
			if err != nil {
				return "", false, err
			}
			parts = appendSystemBlocks(parts, blocks)
		}
	}
	for _, m := range msgs {
		if m.role != "system" {
			continue
		}
		if m.blocks == nil {
			parts = append(parts, m.text)
		} else {
			parts = appendSystemBlocks(parts, m.blocks)
		}
	}
	return strings.Join(parts, ""), len(parts) > 0, nil
}

func appendSystemBlocks(parts []string, blocks []block) []string {
	for _, b := range blocks {
		if b.typ == "text" && b.text != "" && !strings.HasPrefix(b.text, "x-anthropic-billing-header") {
			parts = append(parts, b.text)
		}
	}
	return parts
}

// appendChat is _convert_messages for one message: tool results go out as
// they are met, the message itself after its blocks.
func (m anthropicMessage) appendChat(out []*object) ([]*object, error) {
	if m.role == "system" {
		return out, nil
	}
	msg := &object{}
	msg.set("role", m.role)
	hasContent := false
	if m.blocks == nil {
		msg.set("content", m.text)
		hasContent = true
	} else {
		var parts []*object
		var calls []json.RawMessage
		var reasoning []string
		var err error
		for _, b := range m.blocks {
			switch {
			case b.typ == "text" && b.text != "":
				parts = append(parts, textPart(b.text))
			case b.typ == "image" && b.source != nil && len(b.source.keys) > 0:
				url, err := imageURL(b.source, b.field+".source")
				if err != nil {
					return nil, err
				}
				parts = append(parts, imagePart(url))
			case b.typ == "thinking" && b.hasThinking:
				reasoning = append(reasoning, b.thinking)
			case b.typ == "tool_use":
				call, err := toolCall(b)
				if err != nil {
					return nil, err
				}
				calls = append(calls, call)
			case b.typ == "tool_result" && m.role == "user":
				if out, err = appendToolResult(out, b); err != nil {
					return nil, err
				}
			case b.typ == "tool_result":
				text, err := assistantToolResult(b)
				if err != nil {
					return nil, err
				}
				parts = append(parts, textPart("Tool result: "+text))
			}
		}
		if reasoning != nil {
			msg.set("reasoning", strings.Join(reasoning, ""))
		}
		if calls != nil {
			msg.set("tool_calls", calls)
		}
		if len(parts) == 1 {
			if t, _ := parts[0].get("type"); t == "text" {
				text, _ := parts[0].get("text")
				msg.set("content", text)
				hasContent = true
			}
		}
		if len(parts) > 0 && !hasContent {
			msg.set("content", parts)
			hasContent = true
		}
	}
	if m.role == "user" && !hasContent {
		return out, nil
	}
	return append(out, msg), nil
}

func textPart(text string) *object {
	p := &object{}
	p.set("type", "text")
	p.set("text", text)
	return p
}

func imagePart(url string) *object {
	u := &object{}
	u.set("url", url)
	p := &object{}
	p.set("type", "image_url")
	p.set("image_url", u)
	return p
}

// imageURL is _convert_image_source_to_url: a URL source's url, anything
// else a base64 data URI (media type image/jpeg unless given).
func imageURL(src *object, field string) (string, error) {
	typ, _, _ := str(src, "type", field+".type")
	if typ == "url" {
		u, _, err := str(src, "url", field+".url")
		return u, err
	}
	media, ok, err := str(src, "media_type", field+".media_type")
	if err != nil {
		return "", err
	}
	if !ok {
		media = "image/jpeg"
	}
	data, _, err := str(src, "data", field+".data")
	if err != nil {
		return "", err
	}
	return "data:" + media + ";base64," + data, nil
}

// toolCall is _convert_tool_use_block.
func toolCall(b block) (json.RawMessage, error) {
	if b.id == "" {
		return nil, unsupported(b.field+".id", "vLLM names a tool_use without an id from the clock")
	}
	args := []byte("{}")
	if b.input != nil {
		var err error
		if args, err = appendPyJSON(nil, b.input); err != nil {
			return nil, invalid(b.field+".input", "%v", err)
		}
	}
	fn := &object{}
	fn.set("name", b.name)
	fn.set("arguments", string(args))
	call := &object{}
	call.set("id", b.id)
	call.set("type", "function")
	call.set("function", fn)
	return call.appendJSON(nil), nil
}

// appendToolResult is _convert_user_tool_result: a tool message, then the
// result's images in a user message and its tool references in a second
// tool message.
func appendToolResult(out []*object, b block) ([]*object, error) {
	text := ""
	var images []*object
	var refs []*object
	if b.content != nil && b.content[0] == '"' {
		text, _ = stringValue(b.content) // checked by parseBlocks
	} else if b.content != nil {
		items, _ := parseArray(b.content)
		var texts []string
		for j, r := range items {
			f := index(b.field+".content", j)
			it, err := parseObject(r)
			if err != nil {
				return nil, invalid(f, "must be an object")
			}
			typ, _, _ := str(it, "type", f+".type")
			switch typ {
			case "text":
				t, _, err := str(it, "text", f+".text")
				if err != nil {
					return nil, err
				}
				texts = append(texts, t)
			case "image":
				src, err := child(it, "source", f+".source")
				if err != nil {
					return nil, err
				}
				if src == nil {
					src = &object{}
				}
				url, err := imageURL(src, f+".source")
				if err != nil {
					return nil, err
				}
				if url != "" {
					images = append(images, imagePart(url))
				}
			case "tool_reference":
				name, _, _ := str(it, "tool_name", f+".tool_name")
				if name == "" {
					name, _, _ = str(it, "name", f+".name")
				}
				if name != "" {
					ref := &object{}
					ref.set("type", "tool_reference")
					ref.set("name", name)
					refs = append(refs, ref)
				}
			}
		}
		text = strings.Join(texts, "\n")
	}
	tool := &object{}
	tool.set("role", "tool")
	tool.set("tool_call_id", b.toolUse)
	tool.set("content", text)
	out = append(out, tool)
	if images != nil {
		out = append(out, message("user", images))
	}
	if refs != nil {
		t := &object{}
		t.set("role", "tool")
		t.set("tool_call_id", b.toolUse)
		t.set("content", refs)
		out = append(out, t)
	}
	return out, nil
}

// assistantToolResult is str(block.content) for an assistant's tool_result.
func assistantToolResult(b block) (string, error) {
	if b.content == nil {
		return "", nil
	}
	if b.content[0] == '"' {
		s, _ := stringValue(b.content) // checked by parseBlocks
		return s, nil
	}
	if items, _ := parseArray(b.content); len(items) == 0 {
		return "", nil
	}
	return "", unsupported(b.field+".content", "vLLM prints Python's repr of a tool_result list in an assistant message")
}

// anthropicTools is _convert_tool_choice and _convert_tools.
func anthropicTools(top *object, c *Chat) error {
	choice, err := child(top, "tool_choice", "tool_choice")
	if err != nil {
		return err
	}
	if choice != nil {
		typ, _, err := str(choice, "type", "tool_choice.type")
		if err != nil {
			return err
		}
		switch typ {
		case "auto", "none":
			c.ToolChoice = json.RawMessage(`"` + typ + `"`)
		case "any":
			c.ToolChoice = json.RawMessage(`"required"`)
		case "tool":
			name, _, err := str(choice, "name", "tool_choice.name")
			if err != nil {
				return err
			}
			if name == "" {
				return invalid("tool_choice.name", "is required when type is \"tool\"")
			}
			c.ToolChoice = namedChoice(name)
		default:
			return invalid("tool_choice.type", "must be auto, any, tool or none")
		}
	}
	raw := top.raw("tools")
	if raw == nil {
		return nil
	}
	items, ok := parseArray(raw)
	if !ok {
		return invalid("tools", "must be an array")
	}
	tools := []*object{}
	for i, r := range items {
		field := index("tools", i)
		t, err := parseObject(r)
		if err != nil {
			return invalid(field, "must be an object")
		}
		name, ok, err := str(t, "name", field+".name")
		if err != nil {
			return err
		}
		if !ok {
			return invalid(field+".name", "is required")
		}
		desc, err := optKind(t, "description", field, '"')
		if err != nil {
			return err
		}
		schema, err := child(t, "input_schema", field+".input_schema")
		if err != nil {
			return err
		}
		if schema == nil {
			return invalid(field+".input_schema", "is required")
		}
		if _, has := schema.get("type"); !has {
			schema.set("type", "object")
		}
		if _, err := optKind(t, "strict", field, 't'); err != nil {
			return err
		}
		defer_, err := optKind(t, "defer_loading", field, 't')
		if err != nil {
			return err
		}
		fn := &object{}
		fn.set("name", name)
		fn.set("description", desc)
		fn.set("parameters", schema)
		if string(defer_) != "null" {
			fn.set("defer_loading", defer_)
		}
		tool := &object{}
		tool.set("type", "function")
		tool.set("function", fn)
		tools = append(tools, tool)
	}
	if c.ToolChoice == nil {
		c.ToolChoice = json.RawMessage(`"auto"`)
	}
	c.Tools = appendObjects(nil, tools)
	return nil
}

// optKind returns an optional field (null when absent) after checking its
// JSON kind: '"' string, 't' boolean.
func optKind(o *object, key, field string, kind byte) (json.RawMessage, error) {
	r := o.raw(key)
	if r == nil {
		return json.RawMessage("null"), nil
	}
	got := r[0]
	if got == 'f' {
		got = 't'
	}
	if got != kind {
		return nil, invalid(field+"."+key, "has the wrong JSON type")
	}
	return r, nil
}

// anthropicKwargs is build_chat_params' merge of the request's
// chat_template_kwargs under vLLM's own arguments: output_config.effort
// sets reasoning_effort and, unless the request's kwargs say, enable_thinking.
func anthropicKwargs(top *object) (json.RawMessage, error) {
	out, err := requestKwargs(top)
	if err != nil {
		return nil, err
	}
	cfg, err := child(top, "output_config", "output_config")
	if err != nil {
		return nil, err
	}
	if cfg != nil {
		effort, ok, err := str(cfg, "effort", "output_config.effort")
		if err != nil {
			return nil, err
		}
		if ok {
			switch effort {
			case "low", "medium", "high", "xhigh", "max":
			default:
				return nil, invalid("output_config.effort", "must be low, medium, high, xhigh or max")
			}
			_, userSays := out.get("enable_thinking")
			out.set("reasoning_effort", effort)
			if !userSays {
				out.set("enable_thinking", effort != "none")
			}
		}
	}
	return kwargsJSON(out), nil
}

// requestKwargs returns the request's chat_template_kwargs (empty when
// absent) without add_generation_prompt and continue_final_message, which
// vLLM sets itself over them (Chat's fields).
func requestKwargs(top *object) (*object, error) {
	kw, err := child(top, "chat_template_kwargs", "chat_template_kwargs")
	if err != nil {
		return nil, err
	}
	out := &object{}
	if kw != nil {
		for i, k := range kw.keys {
			if k != "add_generation_prompt" && k != "continue_final_message" {
				out.set(k, kw.vals[i])
			}
		}
	}
	return out, nil
}

// kwargsJSON is the template kwargs object, nil when it has no keys.
func kwargsJSON(kw *object) json.RawMessage {
	if len(kw.keys) == 0 {
		return nil
	}
	return kw.appendJSON(nil)
}
