package chattemplate

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestToolCallArgumentsNormalisedAsVLLM(t *testing.T) {
	tmpl, err := Compile(`{% for m in messages %}{{ m.role }}{% if m.tool_calls is defined %}:{% for c in m.tool_calls %}{{ c.function.arguments | tojson }};{% endfor %}{% endif %}|{% endfor %}`)
	if err != nil {
		t.Fatal(err)
	}
	// Long enough to go through the shared cache (minCachedElement).
	pad := strings.Repeat("p", 300)
	msgs := `[{"role":"user","content":"` + pad + `"},` +
		`{"role":"assistant","content":null,"tool_calls":[` +
		`{"id":"1","type":"function","function":{"name":"a","arguments":"{\"z\": 1, \"a\": [1.0]}"}},` +
		`{"id":"2","type":"function","function":{"name":"b","arguments":"[1, 2]"}},` +
		`{"id":"3","type":"function","function":{"name":"c","arguments":"not json"}},` +
		`{"id":"4","function":{"name":"d"}},` +
		`{"id":"5","type":"function","function":{"name":"e","arguments":{"k":"v"}}}],"pad":"` + pad + `"},` +
		`{"role":"assistant","content":"x","tool_calls":[]},` +
		`{"role":"user","content":"u","tool_calls":[{"function":{"name":"f","arguments":"{\"u\":1}"}}]}]`
	want := `user|assistant:{"z": 1, "a": [1.0]};{};{};{};{"k": "v"};|assistant|user:"{\"u\":1}";|`
	for pass := range 3 { // the second and third passes hit the cache
		got, err := tmpl.Render(Input{Messages: json.RawMessage(msgs)})
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("pass %d:\n got %s\nwant %s", pass, got, want)
		}
	}

	for _, bad := range []string{
		`[{"role":"assistant","tool_calls":[3]}]`,
		`[{"role":"assistant","tool_calls":[{"type":"code_interpreter","function":{"name":"x"}}]}]`,
		`[{"role":"assistant","tool_calls":[{"type":"function"}]}]`,
	} {
		_, err := tmpl.Render(Input{Messages: json.RawMessage(bad)})
		var ie *InputError
		if !errors.As(err, &ie) {
			t.Errorf("%s: want InputError, got %v", bad, err)
		}
	}
}
