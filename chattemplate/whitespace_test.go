package chattemplate

import (
	"encoding/json"
	"fmt"
	"os"
	"testing"
)

// TestJinja2Whitespace renders random templates mixing text, block tags,
// comments and expressions with every whitespace marker ("-", "+", none)
// and compares with jinja2. testdata/jinja2_whitespace.json was generated
// with Python jinja2 3.1.6 configured as transformers does (trim_blocks,
// lstrip_blocks), variables {"i": 7}.
func TestJinja2Whitespace(t *testing.T) {
	data, err := os.ReadFile("testdata/jinja2_whitespace.json")
	if err != nil {
		t.Fatal(err)
	}
	var cases []struct{ Src, Want string }
	if err := json.Unmarshal(data, &cases); err != nil {
		t.Fatal(err)
	}
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) { checkWhitespace(t, cases, direct) })
	}
}

func checkWhitespace(t *testing.T, cases []struct{ Src, Want string }, direct bool) {
	fails := 0
	for i, c := range cases {
		tmpl, err := compile(c.Src, direct)
		if err != nil {
			t.Errorf("case %d: compile %q: %v", i, c.Src, err)
			fails++
			continue
		}
		got, err := tmpl.Render(Input{Messages: json.RawMessage(`[]`), Kwargs: json.RawMessage(`{"i": 7}`)})
		if err != nil {
			t.Errorf("case %d: render %q: %v", i, c.Src, err)
			fails++
			continue
		}
		if got != c.Want {
			fails++
			if fails <= 5 {
				t.Errorf("case %d: %q\n got: %q\nwant: %q", i, c.Src, got, c.Want)
			}
		}
	}
	t.Logf("%d/%d whitespace cases equal jinja2", len(cases)-fails, len(cases))
}
