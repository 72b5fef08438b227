package chattemplate

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"sync"

	"github.com/ardanlabs/jinja"
	"github.com/cespare/xxhash/v2"

	"github.com/kvmesh/kvmesh/admission"
)

// Known templates render without jinja.
//
// Most fleets serve a model whose chat template is a short loop over the
// messages, and for those jinja spends its time on machinery, not output:
// a scope map and a loop dict per message, and a new string per + (a 4 KB
// Llama-3 chat: 18 µs of a 60 µs routing decision on a slow host). A
// template whose preprocessed code is one listed in natives — compared up to
// the amount of whitespace between the tokens of its tags — gets that
// template's renderer written in Go. It renders requests without
// chat_template_kwargs — tools, tool calls and tool results included —
// from messages and tools as vLLM prepared them (content parts joined,
// null content empty, tool-call arguments parsed, tools laid out), the
// tools' JSON cached by their raw bytes (toolTexts). A request it does not
// cover takes the jinja path, so a renderer only has to be exact where it
// says yes. TestNativeMatchesJinja and FuzzNativeMatchesJinja hold both
// paths to the same prompt; the golden prompts from transformers run
// through the native path.

// A nativeRender appends the prompt for msgs (as vLLM prepared them) and
// tools (each tool's tojson text; nil when there are none) to b, or reports
// false, having written nothing, when the request is one it does not cover.
type nativeRender func(b []byte, msgs []jinja.Value, tools []string, bos string, addGenerationPrompt bool) ([]byte, bool)

// A native is a known template's renderer.
type native struct {
	name      string // what Renderer reports
	render    nativeRender
	usesTools bool // render needs the tools' texts (toolTexts)
}

// natives maps a template's fingerprint to its renderer.
var natives = map[[sha256.Size]byte]*native{
	// Meta-Llama-3-8B-Instruct / 70B-Instruct (Llama 3.0).
	mustHex("9202b2eb33071e78490236e3a9215cea920b2c22204d618cb08606c2a06d25f5"): {"native llama3", renderLlama3, false},
	// Qwen2.5-*-Instruct (the template of ../shared/tokenizers/qwen2.5).
	mustHex("a9bd8000710e66e3d6a83738196cfeb324bae87210185534e8f327a8a7de4e1a"): {"native qwen2.5", renderQwen25, true},
}

// Renderer names how the template renders the common request: "native
// llama3" (a renderer of native.go) or "jinja".
func (t *Template) Renderer() string {
	if t.native == nil {
		return "jinja"
	}
	return t.native.name
}

// fingerprint identifies preprocessed template code up to the amount of
// whitespace between the tokens of its tags and at their edges (never inside
// string literals), which jinja ignores: a template saved by a tool that
// spaces tags otherwise is the same template. preprocess has already
// dropped comments and whitespace-control markers and turned text into
// literals.
func fingerprint(pre string) [sha256.Size]byte {
	var b strings.Builder
	b.Grow(len(pre))
	for i := 0; i < len(pre); {
		if i+1 < len(pre) && pre[i] == '{' && (pre[i+1] == '%' || pre[i+1] == '{') {
			closer := "%}"
			if pre[i+1] == '{' {
				closer = "}}"
			}
			b.WriteString(pre[i : i+2])
			i = canonicalTag(&b, pre, i+2, closer)
			continue
		}
		b.WriteByte(pre[i])
		i++
	}
	return sha256.Sum256([]byte(b.String()))
}

// canonicalTag copies the tag body starting at i up to and including its
// closer, whitespace runs outside quotes folded to one space and dropped
// next to the delimiters. It returns the index after the closer.
func canonicalTag(b *strings.Builder, s string, i int, closer string) int {
	space := false
	first := true
	for i < len(s) {
		c := s[i]
		switch {
		case strings.HasPrefix(s[i:], closer):
			b.WriteString(closer)
			return i + len(closer)
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			space = true
			i++
			continue
		}
		if space && !first {
			b.WriteByte(' ')
		}
		space, first = false, false
		if c == '\'' || c == '"' {
			end := i + 1
			for end < len(s) && s[end] != c {
				if s[end] == '\\' {
					end++
				}
				end++
			}
			end = min(end+1, len(s))
			b.WriteString(s[i:end])
			i = end
			continue
		}
		b.WriteByte(c)
		i++
	}
	return i
}

func mustHex(s string) (sum [sha256.Size]byte) {
	if n, err := hex.Decode(sum[:], []byte(s)); err != nil || n != len(sum) {
		panic("chattemplate: bad fingerprint " + s)
	}
	return sum
}

// roleAndContent returns a message's role and content if both are strings.
// Messages as prepareMessage leaves them always are (for templates that do
// not loop over content); the check keeps a renderer exact if that changes.
func roleAndContent(m jinja.Value) (role, content string, ok bool) {
	if !m.IsDict() {
		return "", "", false
	}
	d := m.AsDict()
	r, ok1 := d.Get("role")
	c, ok2 := d.Get("content")
	if !ok1 || !ok2 || !r.IsString() || !c.IsString() {
		return "", "", false
	}
	return r.AsString(), c.AsString(), true
}

// renderLlama3 is Llama 3.0's template: each message as a header, its
// content stripped, <|eot_id|>; bos_token before the first.
func renderLlama3(b []byte, msgs []jinja.Value, _ []string, bos string, addGenerationPrompt bool) ([]byte, bool) {
	if bos == "" { // undefined in the template: let jinja decide what that means
		return b, false
	}
	start := len(b)
	for i, m := range msgs {
		role, content, ok := roleAndContent(m)
		if !ok {
			return b[:start], false
		}
		if i == 0 {
			b = append(b, bos...)
		}
		b = append(b, "<|start_header_id|>"...)
		b = append(b, role...)
		b = append(b, "<|end_header_id|>\n\n"...)
		b = append(b, strings.TrimFunc(content, pyIsSpace)...)
		b = append(b, "<|eot_id|>"...)
	}
	if addGenerationPrompt {
		b = append(b, "<|start_header_id|>assistant<|end_header_id|>\n\n"...)
	}
	return b, true
}

// renderQwen25 is Qwen2.5's template: a system turn (the client's or
// Qwen's default, with the tools' signatures when there are tools), then
// user, system and assistant turns in ChatML, assistant tool calls as
// <tool_call> JSON, and runs of tool results as one user turn.
func renderQwen25(b []byte, msgs []jinja.Value, tools []string, _ string, addGenerationPrompt bool) ([]byte, bool) {
	if len(msgs) == 0 {
		return b, false
	}
	for _, m := range msgs {
		role, _, ok := roleAndContent(m)
		if !ok {
			return b, false
		}
		if calls, has := m.AsDict().Get("tool_calls"); has && role == "assistant" && !validQwenToolCalls(calls) {
			return b, false
		}
	}
	start := len(b)
	role0, content0, _ := roleAndContent(msgs[0])
	switch {
	case len(tools) > 0:
		b = append(b, "<|im_start|>system\n"...)
		if role0 == "system" {
			b = append(b, content0...)
		} else {
			b = append(b, qwenDefaultSystem...)
		}
		b = append(b, "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"...)
		for _, js := range tools {
			b = append(b, '\n')
			b = append(b, js...)
		}
		b = append(b, "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"...)
	case role0 == "system":
		b = append(b, "<|im_start|>system\n"...)
		b = append(b, content0...)
		b = append(b, "<|im_end|>\n"...)
	default:
		b = append(b, "<|im_start|>system\n"+qwenDefaultSystem+"<|im_end|>\n"...)
	}
	for i, m := range msgs {
		role, content, _ := roleAndContent(m)
		calls, hasCalls := m.AsDict().Get("tool_calls")
		switch {
		case role == "user" || (role == "system" && i > 0) || (role == "assistant" && !hasCalls):
			b = append(b, "<|im_start|>"...)
			b = append(b, role...)
			b = append(b, '\n')
			b = append(b, content...)
			b = append(b, "<|im_end|>\n"...)
		case role == "assistant":
			b = append(b, "<|im_start|>assistant"...)
			if content != "" {
				b = append(b, '\n')
				b = append(b, content...)
			}
			for _, call := range calls.AsList().Items {
				fn, _ := call.AsDict().Get("function")
				name, _ := fn.AsDict().Get("name")
				args, _ := fn.AsDict().Get("arguments")
				js, ok := tojson(args)
				if !ok {
					return b[:start], false
				}
				b = append(b, "\n<tool_call>\n{\"name\": \""...)
				b = append(b, name.AsString()...)
				b = append(b, "\", \"arguments\": "...)
				b = append(b, js...)
				b = append(b, "}\n</tool_call>"...)
			}
			b = append(b, "<|im_end|>\n"...)
		case role == "tool":
			if i == 0 || roleOf(msgs[i-1]) != "tool" {
				b = append(b, "<|im_start|>user"...)
			}
			b = append(b, "\n<tool_response>\n"...)
			b = append(b, content...)
			b = append(b, "\n</tool_response>"...)
			if i == len(msgs)-1 || roleOf(msgs[i+1]) != "tool" {
				b = append(b, "<|im_end|>\n"...)
			}
		}
	}
	if addGenerationPrompt {
		b = append(b, "<|im_start|>assistant\n"...)
	}
	return b, true
}

const qwenDefaultSystem = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

// validQwenToolCalls reports whether an assistant's tool_calls are what the
// native renderer covers: a non-empty list of calls whose function has a
// string name. The template reads tool_call.function when it is defined;
// vLLM admits only calls with a function object, drops empty lists and
// always sets arguments (a mapping), so those checks are defensive.
func validQwenToolCalls(calls jinja.Value) bool {
	if !calls.IsList() || calls.AsList().Len() == 0 {
		return false
	}
	for _, c := range calls.AsList().Items {
		if !c.IsDict() {
			return false
		}
		fn, ok := c.AsDict().Get("function")
		if !ok || !fn.IsDict() {
			return false
		}
		name, ok := fn.AsDict().Get("name")
		if !ok || !name.IsString() {
			return false
		}
		if _, ok := fn.AsDict().Get("arguments"); !ok {
			return false
		}
	}
	return true
}

// roleOf returns a message's role (a string, as roleAndContent checked).
func roleOf(m jinja.Value) string {
	r, _ := m.AsDict().Get("role")
	return r.AsString()
}

// tojson is the template's tojson filter (Python's json.dumps as
// transformers configures it) on v.
func tojson(v jinja.Value) (string, bool) {
	out, err := tojsonFilter([]jinja.Value{v}, nil)
	if err != nil || !out.IsString() {
		return "", false
	}
	return out.AsString(), true
}

// toolTexts returns each tool's tojson text (nil, true for no tools), by
// the tools array's raw JSON: agents send the same tools with every
// request, and dumping their schemas was most of such a prompt's render.
// An array is kept from its second sighting, so per-request tools do not
// wash out the others. It reports false when a tool does not dump (it
// cannot, decoded tools being JSON values; the renderer would decline).
func toolTexts(raw []byte, tools jinja.Value) ([]string, bool) {
	if !tools.IsList() || tools.AsList().Len() == 0 {
		return nil, true
	}
	toolJSON.mu.RLock()
	texts, ok := toolJSON.m[string(raw)]
	toolJSON.mu.RUnlock()
	if ok {
		return texts, true
	}
	texts = make([]string, 0, tools.AsList().Len())
	size := len(raw)
	for _, tool := range tools.AsList().Items {
		js, ok := tojson(tool)
		if !ok {
			return nil, false
		}
		texts = append(texts, js)
		size += len(js)
	}
	if size > maxToolJSONBytes/4 || !toolJSON.door.Admit(xxhash.Sum64(raw)) {
		return texts, true
	}
	toolJSON.mu.Lock()
	if _, dup := toolJSON.m[string(raw)]; !dup {
		if toolJSON.bytes+size > maxToolJSONBytes {
			toolJSON.m = map[string][]string{}
			toolJSON.bytes = 0
		}
		toolJSON.m[string(raw)] = texts
		toolJSON.bytes += size
	}
	toolJSON.mu.Unlock()
	return texts, true
}

// maxToolJSONBytes bounds toolJSON (raw arrays and their texts together).
const maxToolJSONBytes = 8 << 20

var toolJSON = struct {
	mu    sync.RWMutex
	m     map[string][]string
	bytes int
	door  *admission.Doorkeeper
}{m: map[string][]string{}, door: admission.New(1 << 12)}
