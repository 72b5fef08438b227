package request

import (
	"encoding/json"
	"reflect"
	"testing"
)

// TestParse: what each shape yields, and the 400 each malformed one gets.
func TestParse(t *testing.T) {
	yes := true
	cases := []struct {
		name string
		kind Kind
		body string
		want Request // Messages, Prompt and StreamOptions not compared
		err  string
	}{
		{"chat", Chat, `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"cache_salt":"s","max_tokens":8}`,
			Request{Kind: Chat, Model: "m", Stream: true, WantsUsage: true, CacheSalt: "s", MaxTokens: json.RawMessage("8")}, ""},
		{"chat with tools and options", Chat, `{"messages":[{}],"tools":[{"type":"function"}],"add_generation_prompt":true,"chat_template_kwargs":{"x":1}}`,
			Request{Kind: Chat, Tools: json.RawMessage(`[{"type":"function"}]`), AddGenerationPrompt: &yes, ChatTemplateKwargs: json.RawMessage(`{"x":1}`)}, ""},
		{"null tools", Chat, `{"messages":[{}],"tools":null}`, Request{Kind: Chat}, ""},
		{"completion text", Completion, `{"model":"m","prompt":"Once"}`, Request{Kind: Completion, Model: "m", PromptText: "Once"}, ""},
		{"completion batch", Completion, `{"prompt":["a","b"]}`, Request{Kind: Completion, PromptText: "a"}, ""},
		{"completion ids", Completion, `{"prompt":[1,2,3]}`, Request{Kind: Completion, PromptIDs: []uint32{1, 2, 3}}, ""},
		{"completion id batch", Completion, `{"prompt":[[4],[5,6]]}`, Request{Kind: Completion, PromptIDs: []uint32{4}}, ""},
		{"no messages", Chat, `{"model":"m"}`, Request{}, "messages is required"},
		{"empty messages", Chat, `{"messages":[]}`, Request{}, "messages must not be empty"},
		{"message not an object", Chat, `{"messages":[{},"x"]}`, Request{}, "messages[1] must be an object"},
		{"tools not an array", Chat, `{"messages":[{}],"tools":{}}`, Request{}, "tools must be an array"},
		{"no prompt", Completion, `{}`, Request{}, "prompt is required"},
		{"empty prompt list", Completion, `{"prompt":[]}`, Request{}, "prompt must not be an empty list"},
		{"model not a string", Chat, `{"model":1,"messages":[{}]}`, Request{}, `field "model" has the wrong type: got number, want string`},
		{"not an object", Chat, `[1]`, Request{}, "request body must be a JSON object"},
		{"bad stream_options", Chat, `{"messages":[{}],"stream_options":1}`, Request{}, "stream_options must be an object with a boolean include_usage"},
	}
	for _, c := range cases {
		got, err := Parse([]byte(c.body), c.kind)
		if c.err != "" {
			e, ok := err.(*Error)
			if !ok || e.Status != 400 || e.Type != "invalid_request_error" || e.Message != c.err {
				t.Errorf("%s: error %#v, want a 400 %q", c.name, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		got.Messages, got.Prompt, got.StreamOptions = nil, nil, nil
		if !reflect.DeepEqual(*got, c.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", c.name, *got, c.want)
		}
	}
}

// TestParsePassthrough: a JSON body or a multipart form gives the model and
// the stream flag.
func TestParsePassthrough(t *testing.T) {
	r, err := ParsePassthrough([]byte(`{"model":"e","input":"x","stream":true}`), "")
	if err != nil || r.Model != "e" || !r.Stream || r.Kind != Passthrough {
		t.Fatalf("json: %+v, %v", r, err)
	}
	form := "--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nRIFF\r\n--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b\r\nContent-Disposition: form-data; name=\"stream\"\r\n\r\ntrue\r\n--b--\r\n"
	r, err = ParsePassthrough([]byte(form), "b")
	if err != nil || r.Model != "whisper" || !r.Stream {
		t.Fatalf("multipart: %+v, %v", r, err)
	}
	if _, err := ParsePassthrough([]byte("--x\r\n"), "b"); err == nil {
		t.Fatal("a malformed form was accepted")
	}
}

// TestChatInput: vLLM's defaults for a chat's rendering options.
func TestChatInput(t *testing.T) {
	r, _ := Parse([]byte(`{"messages":[{}]}`), Chat)
	c := r.ChatInput()
	if !c.AddGenerationPrompt || c.ContinueFinalMessage || c.AddSpecialTokens || c.Tools != nil || c.TemplateKwargs != nil || !r.PromptSpecialTokens() {
		t.Fatalf("defaults: %+v", c)
	}
	r, _ = Parse([]byte(`{"messages":[{}],"add_generation_prompt":false,"continue_final_message":true,"add_special_tokens":true}`), Chat)
	if c := r.ChatInput(); c.AddGenerationPrompt || !c.ContinueFinalMessage || !c.AddSpecialTokens {
		t.Fatalf("as sent: %+v", c)
	}
}

func TestWithPriorityIsAppendedLast(t *testing.T) {
	for body, want := range map[string]string{
		`{"model":"m","priority":5}`: `{"model":"m","priority":5,"priority":-1}`,
		"{\"model\":\"m\"}\n":        "{\"model\":\"m\",\"priority\":-1}\n",
		`{}`:                         `{"priority":-1}`,
	} {
		got, err := WithPriority([]byte(body), -1)
		if err != nil || string(got) != want {
			t.Errorf("%q: %q %v, want %q", body, got, err, want)
		}
	}
	if _, err := WithPriority([]byte(`[1]`), 0); err == nil {
		t.Error("an array accepted")
	}
}
