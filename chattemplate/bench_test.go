package chattemplate

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
)

// longChat builds a multi-turn chat of about `chars` characters of content
// (~4 characters per Llama-3 token, so 128 KiB ≈ 32k tokens) as request JSON.
func longChat(chars, perMessage int) json.RawMessage {
	words := strings.Fields(`the router keeps a bloom filter of every resident block and scores
		replicas by predicted time to first token; a growing conversation re-sends its history
		so the prefix is cached, and only the newest turn needs new work — "quoted" text, tabs	and
		unicode like Zürich, 東京 and 😀 appear too`)
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	msgs := []msg{{Role: "system", Content: "You are a helpful assistant."}}
	total, w := 0, 0
	for i := 0; total < chars; i++ {
		var b strings.Builder
		for b.Len() < perMessage {
			b.WriteString(words[w%len(words)])
			b.WriteByte(' ')
			w++
		}
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, msg{Role: role, Content: fmt.Sprintf("turn %d: %s", i, b.String())})
		total += b.Len()
	}
	if msgs[len(msgs)-1].Role != "user" {
		msgs = append(msgs, msg{Role: "user", Content: "and now?"})
	}
	data, err := json.Marshal(msgs)
	if err != nil {
		panic(err)
	}
	return data
}

// BenchmarkRenderLlama3_32k renders a ~32k-token, 200-turn chat with the
// Llama-3 template: the whole cost the router pays per chat request before
// tokenizing (JSON → ordered values, then template execution).
//
//   - cached: the same chat again; every message's prepared value comes
//     from the shared cache;
//   - growing: each request adds a new ~2 KB user turn to the same earlier
//     turns (the router's common case): one miss, the rest hits;
//   - cold: no cache, every message decoded and prepared.
//
// Each runs the native renderer (native.go) and, as its baseline, jinja.
func BenchmarkRenderLlama3_32k(b *testing.B) {
	tmpl, err := Compile(llama3Template)
	if err != nil {
		b.Fatal(err)
	}
	in := Input{Messages: longChat(128<<10, 640), AddGenerationPrompt: true, BOSToken: "<|begin_of_text|>", EOSToken: "<|eot_id|>"}
	// newTurn returns the chat with a fresh last user turn (~2 KB), as a
	// growing conversation sends it: every earlier message is a cache hit,
	// the new one a miss.
	prefix := in.Messages[:len(in.Messages)-1]
	turn := strings.Repeat("and one more question about the routing of long chats ", 36)
	var buf []byte // reused: Render keeps no reference to the request bytes
	newTurn := func(n int) Input {
		buf = append(buf[:0], prefix...)
		buf = append(buf, `,{"role":"user","content":"`...)
		buf = strconv.AppendInt(buf, int64(n), 10)
		buf = append(buf, turn...)
		buf = append(buf, `"}]`...)
		next := in
		next.Messages = buf
		return next
	}
	for _, mode := range []string{"cached/native", "cached/jinja", "growing/native", "growing/jinja", "cold/native", "cold/jinja"} {
		b.Run(mode, func(b *testing.B) {
			t := *tmpl
			if strings.HasPrefix(mode, "cold") {
				t.values = nil
			}
			if strings.HasSuffix(mode, "jinja") {
				t.native = nil
			}
			startRender(b, &t, in)
			cpu0 := processCPU()
			n := 0
			for b.Loop() {
				req := in
				if strings.HasPrefix(mode, "growing") {
					n++
					req = newTurn(n)
				}
				if _, err := t.Render(req); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
		})
	}
}

// BenchmarkDecodeMessages_32k is the JSON → ordered values part alone.
func BenchmarkDecodeMessages_32k(b *testing.B) {
	raw := longChat(128<<10, 640)
	decoders := []struct {
		name string
		fn   func() error
	}{
		{"cold", func() error { _, err := decodeJSON(string(raw)); return err }},
		{"cached", func() error { _, err := sharedValues.decodeArray(raw); return err }},
	}
	for _, d := range decoders {
		b.Run(d.name, func(b *testing.B) {
			b.SetBytes(int64(len(raw)))
			b.ReportAllocs()
			cpu0 := processCPU()
			for b.Loop() {
				if err := d.fn(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
		})
	}
}

// BenchmarkRenderQwenTools renders an agent's turn with Qwen2.5's template:
// ten tool schemas, an assistant tool call and its result (about 4 KB), the
// native renderer against jinja. Decoded tools and messages come from the
// cache in both, so the difference is the rendering alone.
func BenchmarkRenderQwenTools(b *testing.B) {
	tmpl, err := Compile(qwen25Template)
	if err != nil {
		b.Fatal(err)
	}
	var tools []string
	for i := range 10 {
		tools = append(tools, fmt.Sprintf(`{"type":"function","function":{"name":"tool_%d","description":"Look something up in the company's knowledge base and return the matching passages.","parameters":{"type":"object","properties":{"query":{"type":"string","description":"what to look for"},"limit":{"type":"integer"}},"required":["query"]}}}`, i))
	}
	in := Input{
		Messages: json.RawMessage(`[{"role":"system","content":"You are a helpful agent."},{"role":"user","content":"Find the travel policy."},` +
			`{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"tool_1","arguments":"{\"query\":\"travel policy\",\"limit\":3}"}}]},` +
			`{"role":"tool","tool_call_id":"c1","content":"Employees book economy class for flights under six hours."},{"role":"user","content":"And for longer flights?"}]`),
		Tools:               json.RawMessage("[" + strings.Join(tools, ",") + "]"),
		AddGenerationPrompt: true,
	}
	for _, path := range []string{"native", "jinja"} {
		b.Run(path, func(b *testing.B) {
			t := *tmpl
			if path == "jinja" {
				t.native = nil
			}
			startRender(b, &t, in)
			for b.Loop() {
				if _, err := t.Render(in); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// startRender renders in once, to fail early and to count the prompt's
// bytes in b's throughput, and reports allocations.
func startRender(b *testing.B, t *Template, in Input) {
	out, err := t.Render(in)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(out)))
	b.ReportAllocs()
}
