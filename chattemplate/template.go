// Package chattemplate renders a chat request's prompt exactly as vLLM
// builds it — vLLM's request handling (messages and tools as it prepares
// them), then transformers' apply_chat_template(tokenize=False) — so the
// router can tokenize the very prompt the engine will.
//
// transformers renders with jinja2's ImmutableSandboxedEnvironment
// (trim_blocks, lstrip_blocks, loop controls) plus raise_exception,
// strftime_now and a tojson filter equal to Python's json.dumps with
// ensure_ascii=False. This package runs github.com/ardanlabs/jinja v1.8.0
// and closes, from outside it, the gaps that change prompts:
//
//   - template source is preprocessed as jinja2's lexer does it: newlines
//     folded ("\r\n" and "\r" to "\n", one trailing newline dropped) and
//     whitespace control (trim_blocks, lstrip_blocks, "-" and "+" markers)
//     applied here, because jinja v1.8.0 trims past expressions;
//   - request JSON is decoded into ordered values, so tools and tool-call
//     arguments keep the client's key order, ints stay ints and 1.0 stays a
//     float;
//   - tojson, trim, string and list are replaced by Python-exact versions
//     (insertion key order, ", "/": " separators, indent=, sort_keys=,
//     non-ASCII and U+2028 kept, Python's whitespace set), format is added,
//     every printed value goes through Python's str() (1.0 prints "1.0",
//     None "None"), and string and float literals in template code are
//     decoded as jinja2 does ('\u00e9', '\r', 1e-7);
//   - output goes straight into a buffer sized from the request (jinja's own
//     builder starts empty and doubles), unless the template captures output
//     (macros, call/filter blocks, {% set x %} blocks);
//   - decoded messages (and tools arrays) are kept in a process-wide LRU
//     keyed by their exact JSON bytes (64 MiB), so a growing conversation
//     decodes only its new turns;
//   - messages are rebuilt as vLLM's parse_chat_messages does before it
//     renders: only role, content and the fields vLLM copies survive
//     (assistant tool_calls and reasoning, tool tool_call_id, string name),
//     content null becomes "", text parts are joined with "\n" — or, for
//     templates that loop over message content (vLLM's "openai" content
//     format, detected here by pattern rather than vLLM's AST walk), every
//     content becomes a list of text parts; media parts (images, audio...)
//     are an InputError with Media set and the index of their message;
//   - assistant tool calls are normalised as vLLM does (function.arguments
//     sent as a JSON string becomes a mapping, invalid or missing arguments
//     become {}, an empty tool_calls list is dropped);
//   - tools are validated and laid out as vLLM's pydantic model_dump() does
//     (type, function{name, description, parameters} first — null when
//     missing — then extra fields in request order);
//   - raise_exception yields a *TemplateError carrying the template's message;
//   - continue_final_message cuts the prompt after the final message's
//     content, as transformers does;
//   - CutMessages keeps the leading messages of a long chat, for the
//     templates known to render messages in order (RendersInOrder), so
//     that a router can render only the start of the prompt (cut.go);
//   - the templates of some common models (Llama 3, Qwen2.5), recognised by
//     their source, render requests without chat_template_kwargs in Go
//     rather than jinja: the same prompt, in a fraction of the time and
//     garbage (native.go).
//
// Known differences left inside jinja v1.8.0's evaluator (see
// knownExpressionGaps in the tests): the ~ operator prints None as "" and
// floats Go-style; int ** int is a float; a filter binds before unary minus
// (-3 | abs); no % string-formatting operator and no str.join method;
// dictsort pairs print as lists; the string methods
// .strip()/.lstrip()/.rstrip()/.split() use Go's whitespace set; a macro
// that recurses without end overflows the stack, and range(10**9) or
// 'x' * 10**9 run as long as they say (template source is trusted
// configuration; render time otherwise grows with the request, which the
// caller must bound). Templates that would raise
// a Python TypeError (str + None) may render instead of failing (vLLM
// rejects such requests, so nothing is routed wrongly). The vLLM request
// handling mirrored here follows vLLM's main branch (chat_utils.py,
// protocol.py); details such as which reasoning field is copied have
// changed between vLLM releases.
package chattemplate

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
	"unsafe"

	"encoding/json"

	"github.com/ardanlabs/jinja"
)

// Template is a compiled chat template. It is safe for concurrent Render.
type Template struct {
	tmpl *jinja.Template
	// values decodes request JSON; nil (no cache) for templates that could
	// mutate their input.
	values *valueCache
	// direct: all output goes through kvmesh_emit__ into a pre-sized
	// buffer (see emitter); sourceBytes helps size it.
	direct      bool
	sourceBytes int
	// openaiParts: the template loops over message content, so vLLM hands
	// it content as a list of parts (its "openai" content format).
	openaiParts bool
	// helpers: those of the package's helpers the source names.
	helpers []helper
	// native renders the common request without jinja (native.go); nil
	// for templates it does not know.
	native *native
}

// Input is what decides one rendered prompt. Messages, Tools and Kwargs are
// raw request JSON so that key order survives into the template.
type Input struct {
	// Messages is the JSON array of chat messages (objects with a "role").
	Messages json.RawMessage
	// Tools is the JSON array of tool schemas; nil or "null" means no tools
	// (the template sees tools = none, as transformers passes it).
	Tools json.RawMessage
	// Kwargs is the chat_template_kwargs JSON object; its keys become extra
	// template variables. As in vLLM, which merges them over its own
	// arguments, they may replace add_generation_prompt, tools, documents,
	// continue_final_message and the special tokens; "messages" is refused.
	Kwargs json.RawMessage
	// AddGenerationPrompt asks the template to open the assistant turn.
	AddGenerationPrompt bool
	// ContinueFinalMessage ends the prompt right after the final message's
	// content so the model continues it. It excludes AddGenerationPrompt.
	ContinueFinalMessage bool
	// BOSToken and EOSToken are the tokenizer's special token strings; empty
	// means the tokenizer has none and the variable stays undefined. Other
	// special tokens (unk_token, pad_token, ...) can be passed in Kwargs.
	BOSToken, EOSToken string
}

// TemplateError is raised by the template itself via raise_exception, e.g.
// "Conversation roles must alternate user/assistant/user/assistant/...".
// It means the request does not fit the model's chat format.
type TemplateError struct {
	Message string
}

func (e *TemplateError) Error() string { return "TemplateError: " + e.Message }

// InputError reports request JSON the renderer cannot accept.
type InputError struct {
	Field  string // "messages", "tools", "chat_template_kwargs", ...
	Reason string
	// Media is set when the input is well formed but a message holds a
	// content part that is not text (an image, audio, a video...): the
	// engine's processor turns it into tokens the renderer cannot know.
	// Message is the index of the first such message; the messages before
	// it render as the engine renders them.
	Media   bool
	Message int
}

func (e *InputError) Error() string {
	return "chattemplate: invalid " + e.Field + ": " + e.Reason
}

// ErrRender wraps any other failure raised while executing the template
// (an unknown filter, a failing tojson, ...). Test with errors.Is.
var ErrRender = errors.New("chattemplate: render failed")

// Compile parses a chat template. The source may use CRLF line endings.
func Compile(src string) (*Template, error) {
	return compile(src, true)
}

// compile parses src; allowDirect=false forces jinja's own output buffer
// (tests run both modes).
func compile(src string, allowDirect bool) (t *Template, err error) {
	defer func() {
		if r := recover(); r != nil {
			t, err = nil, fmt.Errorf("chattemplate: compile: template parser panic: %v", r)
		}
	}()
	pre, captures, err := preprocess(src, false)
	if err != nil {
		return nil, fmt.Errorf("chattemplate: compile: %w", err)
	}
	fp := fingerprint(pre)
	direct := allowDirect && !captures
	if direct {
		if pre, _, err = preprocess(src, true); err != nil {
			return nil, fmt.Errorf("chattemplate: compile: %w", err)
		}
	}
	jt, err := jinja.Compile(pre)
	if err != nil {
		return nil, fmt.Errorf("chattemplate: compile: %w", err)
	}
	t = &Template{tmpl: jt, direct: direct, sourceBytes: len(pre), openaiParts: contentLoop.MatchString(pre)}
	t.native = natives[fp]
	for _, h := range helpers {
		// Jinja has no lookup by computed name: a helper the source does not
		// name cannot be reached, and each variable costs a map insert (and
		// jinja's scope growth) on every render.
		if strings.Contains(pre, h.name) {
			t.helpers = append(t.helpers, h)
		}
	}
	if !mayMutateInput(pre) {
		t.values = sharedValues
	}
	return t, nil
}

// helpers are the functions every template may use; Kwargs cannot replace
// them.
var helpers = []helper{
	{"raise_exception", raiseExceptionValue},
	{"strftime_now", strftimeNowValue},
	{overriddenFilters["tojson"], tojsonValue},
	{overriddenFilters["trim"], trimValue},
	{pyStrFilterName, pyStrValue},
	{overriddenFilters["list"], listValue},
	{overriddenFilters["format"], formatValue},
}

type helper struct {
	name  string
	value jinja.Value
}

var (
	tojsonValue         = jinja.NewCallable("tojson", tojsonFilter)
	trimValue           = jinja.NewCallable("trim", trimFilter)
	pyStrValue          = jinja.NewCallable("string", pyStrFilter)
	listValue           = jinja.NewCallable("list", listFilter)
	formatValue         = jinja.NewCallable("format", formatFilter)
	raiseExceptionValue = jinja.NewCallable("raise_exception", raiseException)
	strftimeNowValue    = jinja.NewCallable("strftime_now", strftimeNow)
)

func raiseException(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	msg := ""
	if len(args) > 0 {
		msg = pyStr(args[0])
	}
	return jinja.Undefined(), &TemplateError{Message: msg}
}

func pyStrFilter(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.NewString(""), nil
	}
	if args[0].IsString() {
		return args[0], nil
	}
	return jinja.NewString(pyStr(args[0])), nil
}

func strftimeNow(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	if len(args) != 1 || !args[0].IsString() {
		return jinja.Undefined(), fmt.Errorf("strftime_now(format) takes one string")
	}
	return jinja.NewString(strftime(args[0].AsString(), time.Now())), nil
}

// Render renders the template for one request.
func (t *Template) Render(in Input) (string, error) {
	// The buffer is this call's own and never written again
	// (strings.Builder's String does the same).
	var buf []byte
	return t.RenderInto(&buf, in)
}

// RenderInto renders the template for one request, for a caller that needs
// the prompt only until its next render: native renderers write it into
// (*buf)[:0], leave *buf holding the buffer used (grown if it had to be),
// and the prompt returned shares that memory; jinja's output is returned
// as it is, *buf untouched.
func (t *Template) RenderInto(buf *[]byte, in Input) (string, error) {
	out, jinjaOut, native, err := t.render((*buf)[:0], in)
	if !native {
		return jinjaOut, err
	}
	*buf = out
	if err != nil || len(out) == 0 {
		return "", err
	}
	return unsafe.String(unsafe.SliceData(out), len(out)), nil
}

// AppendRender appends the prompt for one request to dst: a caller that
// reuses dst across requests makes no garbage for prompts the native
// renderers produce (jinja's output is copied in: for templates Renderer
// calls "jinja", Render saves that copy). On error it returns dst unchanged.
func (t *Template) AppendRender(dst []byte, in Input) ([]byte, error) {
	buf, out, native, err := t.render(dst, in)
	switch {
	case err != nil:
		return dst, err
	case native:
		return buf, nil
	}
	return append(dst, out...), nil
}

// render renders in natively, appended to dst (native true), or else
// through jinja, as out.
func (t *Template) render(dst []byte, in Input) (buf []byte, out string, native bool, err error) {
	msgs, tools, err := t.decode(in)
	if err != nil {
		return dst, "", false, err
	}
	if buf, native, err = t.renderNative(dst, in, msgs, tools); native || err != nil {
		return buf, "", native, err
	}
	out, err = t.renderJinja(in, msgs, tools)
	return dst, out, false, err
}

// decode decodes a request's messages and tools, in the order vLLM checks
// them (so a request with both wrong reports its messages).
func (t *Template) decode(in Input) (msgs, tools jinja.Value, err error) {
	if msgs, err = t.decodeMessages(in.Messages); err != nil {
		return msgs, tools, err
	}
	tools, err = t.decodeTools(in.Tools)
	return msgs, tools, err
}

// renderNative appends the prompt to dst if the template has a native
// renderer that covers in; ok is false (dst unchanged) otherwise.
func (t *Template) renderNative(dst []byte, in Input, msgs, tools jinja.Value) (out []byte, ok bool, err error) {
	if t.native == nil || !isNull(in.Kwargs) || (in.ContinueFinalMessage && in.AddGenerationPrompt) {
		return dst, false, nil
	}
	var texts []string
	if t.native.usesTools {
		if texts, ok = toolTexts(in.Tools, tools); !ok {
			return dst, false, nil
		}
	}
	if dst == nil {
		// Templates add a header per message where the JSON had its keys.
		size := len(in.Messages) + 64*msgs.AsList().Len() + 256
		for _, text := range texts {
			size += len(text) + 1
		}
		dst = make([]byte, 0, size)
	}
	start := len(dst)
	if out, ok = t.native.render(dst, msgs.AsList().Items, texts, in.BOSToken, in.AddGenerationPrompt); !ok {
		return dst[:start], false, nil
	}
	if in.ContinueFinalMessage {
		cut, err := cutAfterFinalMessage(string(out[start:]), msgs.AsList())
		if err != nil {
			return dst[:start], true, err
		}
		out = out[:start+len(cut)]
	}
	return out, true, nil
}

// renderJinja renders through jinja.
func (t *Template) renderJinja(in Input, msgs, tools jinja.Value) (out string, err error) {
	vars, messages, cont, err := t.buildVars(in, msgs, tools)
	if err != nil {
		return "", err
	}
	var buf *strings.Builder
	if t.direct {
		buf = new(strings.Builder)
		buf.Grow(len(in.Messages) + len(in.Tools) + t.sourceBytes + 256)
		vars[emitFuncName] = jinja.NewCallable("emit", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			for _, a := range args {
				buf.WriteString(pyStr(a))
			}
			return jinja.None(), nil
		})
	}
	out, err = t.execute(vars)
	if err != nil {
		return "", err
	}
	if t.direct {
		if out != "" { // every output node was rewritten to emit; cannot happen
			return "", fmt.Errorf("%w: output outside the emit buffer", ErrRender)
		}
		out = buf.String()
	}
	if cont {
		return cutAfterFinalMessage(out, messages)
	}
	return out, nil
}

// execute runs the jinja template; a panic inside the engine (a value shape
// it did not expect) becomes an error instead of taking the process down.
func (t *Template) execute(vars map[string]jinja.Value) (out string, err error) {
	defer func() {
		if r := recover(); r != nil {
			out, err = "", fmt.Errorf("%w: template engine panic: %v", ErrRender, r)
		}
	}()
	out, err = t.tmpl.RenderValues(vars)
	if err != nil {
		var te *TemplateError
		if errors.As(err, &te) {
			return "", te
		}
		return "", fmt.Errorf("%w: %w", ErrRender, err)
	}
	return out, nil
}

// buildVars assembles the template variables as vLLM and transformers do:
// special tokens, messages, tools, documents and add_generation_prompt,
// then chat_template_kwargs on top — vLLM merges them over its own
// arguments, so they may replace add_generation_prompt, tools, documents,
// continue_final_message and special tokens (chat_template and tokenize are
// dropped; messages cannot be replaced). msgs and tools are the decoded
// messages and tools. It reports the effective continue_final_message.
func (t *Template) buildVars(in Input, msgs, tools jinja.Value) (vars map[string]jinja.Value, msgList *jinja.List, cont bool, err error) {
	vars = make(map[string]jinja.Value, 16)
	// transformers passes only the special tokens a tokenizer has (Qwen has
	// no BOS), so an empty one stays undefined ("is defined" is false).
	if in.BOSToken != "" {
		vars["bos_token"] = jinja.NewString(in.BOSToken)
	}
	if in.EOSToken != "" {
		vars["eos_token"] = jinja.NewString(in.EOSToken)
	}

	vars["messages"] = msgs

	vars["tools"] = tools
	vars["documents"] = jinja.None()
	vars["add_generation_prompt"] = jinja.NewBool(in.AddGenerationPrompt)
	cont = in.ContinueFinalMessage

	if !isNull(in.Kwargs) {
		kw, err := decodeJSON(string(in.Kwargs))
		if err != nil {
			return nil, nil, false, &InputError{Field: "chat_template_kwargs", Reason: err.Error()}
		}
		if !kw.IsDict() {
			return nil, nil, false, &InputError{Field: "chat_template_kwargs", Reason: "must be a JSON object"}
		}
		d := kw.AsDict()
		for _, k := range d.Keys {
			v, _ := d.Get(k)
			switch k {
			case "chat_template", "tokenize":
				// vLLM drops these
			case "messages", "conversation":
				return nil, nil, false, &InputError{Field: "chat_template_kwargs", Reason: fmt.Sprintf("may not set %q", k)}
			case "continue_final_message":
				cont = v.IsTruthy() // an argument of apply_chat_template, not a variable
			case "tools", "documents":
				// transformers takes these as given: a list of mappings or none
				if !v.IsNone() && !isListOfDicts(v) {
					return nil, nil, false, &InputError{Field: "chat_template_kwargs", Reason: fmt.Sprintf("%q must be a list of objects", k)}
				}
				vars[k] = v
			default:
				vars[k] = v
			}
		}
	}
	if cont && vars["add_generation_prompt"].IsTruthy() {
		return nil, nil, false, &InputError{Field: "request", Reason: "continue_final_message and add_generation_prompt are not compatible"}
	}

	for _, h := range t.helpers {
		vars[h.name] = h.value
	}
	return vars, msgs.AsList(), cont, nil
}

// decodeTools decodes the tools array as vLLM lays it out for the template
// (normalizeTools), through the decode cache when allowed; none when raw is
// absent or null.
func (t *Template) decodeTools(raw json.RawMessage) (jinja.Value, error) {
	if isNull(raw) {
		return jinja.None(), nil
	}
	prep := func(v jinja.Value, _ int) (jinja.Value, error) {
		if !v.IsList() {
			return jinja.Undefined(), &InputError{Field: "tools", Reason: "must be a JSON array"}
		}
		return normalizeTools(v.AsList())
	}
	var tools jinja.Value
	var err error
	if t.values != nil {
		tools, err = t.values.decodePrep(raw, 0, 't', prep, 0)
	} else {
		tools, err = decodeAndPrep(string(raw), 0, prep, 0)
	}
	if err != nil {
		var ie *InputError
		if errors.As(err, &ie) {
			return jinja.Undefined(), err
		}
		return jinja.Undefined(), &InputError{Field: "tools", Reason: err.Error()}
	}
	return tools, nil
}

func isListOfDicts(v jinja.Value) bool {
	if !v.IsList() {
		return false
	}
	for _, item := range v.AsList().Items {
		if !item.IsDict() {
			return false
		}
	}
	return true
}

// decodeMessages decodes the messages array into what vLLM hands the
// template (see prepareMessage), through the decode cache when allowed.
func (t *Template) decodeMessages(raw json.RawMessage) (jinja.Value, error) {
	if len(raw) == 0 {
		return jinja.Undefined(), &InputError{Field: "messages", Reason: "missing"}
	}
	prep := func(v jinja.Value, i int) (jinja.Value, error) { return prepareMessage(v, i, t.openaiParts) }
	kind := byte('m')
	if t.openaiParts {
		kind = 'M'
	}
	var v jinja.Value
	var err error
	if t.values != nil {
		v, err = t.values.decodeArrayPrep(raw, kind, prep)
	} else {
		v, err = decodeWholeArray(raw, prep)
	}
	if err != nil {
		var ie *InputError
		if errors.As(err, &ie) {
			return jinja.Undefined(), err
		}
		return jinja.Undefined(), &InputError{Field: "messages", Reason: err.Error()}
	}
	if !v.IsList() {
		return jinja.Undefined(), &InputError{Field: "messages", Reason: "must be a JSON array"}
	}
	return v, nil
}

var (
	mutatingCall  = regexp.MustCompile(`\.\s*(append|update|pop|popitem|extend|insert|clear|remove|setdefault|sort|reverse)\s*\(`)
	attrAssign    = regexp.MustCompile(`\bset\s+([A-Za-z_]\w*)\s*\.`)
	namespaceVars = regexp.MustCompile(`\bset\s+([A-Za-z_]\w*)\s*=\s*namespace\s*\(`)
)

// mayMutateInput reports whether a template might change the values it is
// given (a mutating method call, or {% set x.attr = ... %} on anything but a
// namespace). jinja2's immutable sandbox forbids both, so such templates do
// not work under transformers; they just must not poison the shared cache.
func mayMutateInput(src string) bool {
	if mutatingCall.MatchString(src) {
		return true
	}
	namespaces := map[string]bool{}
	for _, m := range namespaceVars.FindAllStringSubmatch(src, -1) {
		namespaces[m[1]] = true
	}
	for _, m := range attrAssign.FindAllStringSubmatch(src, -1) {
		if !namespaces[m[1]] {
			return true
		}
	}
	return false
}

func isNull(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s == "" || s == "null"
}

// cutAfterFinalMessage is transformers' continue_final_message: find the
// final message's (stripped) content in the rendered prompt, last
// occurrence, and cut right after it — keeping its trailing whitespace only
// if the template kept it too.
func cutAfterFinalMessage(rendered string, messages *jinja.List) (string, error) {
	if messages.Len() == 0 {
		return "", &InputError{Field: "messages", Reason: "continue_final_message needs at least one message"}
	}
	final, ok := messages.Get(messages.Len() - 1).AsDict().Get("content")
	var text string
	switch {
	case ok && final.IsString():
		text = final.AsString()
	case ok && final.IsList():
		found := false
		items := final.AsList().Items
		for i := len(items) - 1; i >= 0 && !found; i-- {
			if items[i].IsDict() {
				if t, has := items[i].AsDict().Get("text"); has && t.IsString() {
					text, found = t.AsString(), true
				}
			}
		}
		if !found {
			return "", &InputError{Field: "messages", Reason: "continue_final_message is set but we could not find any text to continue in the final message"}
		}
	default:
		return "", &InputError{Field: "messages", Reason: "continue_final_message is set but the final message has no text content"}
	}
	stripped := strings.TrimFunc(text, pyIsSpace)
	loc := strings.LastIndex(rendered, stripped)
	if loc < 0 {
		return "", &InputError{Field: "messages", Reason: "continue_final_message is set but the final message does not appear in the chat after applying the chat template"}
	}
	lstripped := strings.TrimLeftFunc(text, pyIsSpace)
	if end := loc + len(lstripped); end <= len(rendered) && rendered[loc:end] == text {
		return rendered[:end], nil
	}
	return rendered[:loc+len(stripped)], nil
}
