package chattemplate

import (
	"encoding/json"
	"os"
	"regexp"
	"testing"
)

// knownExpressionGaps lists the snippets of testdata/jinja2_expressions.json
// where jinja v1.8.0 still differs from jinja2, keyed by the snippet, with
// the reason. They are behaviours of the engine's evaluator that cannot be
// replaced from outside it; none is used by the golden models' templates.
var knownExpressionGaps = map[string]string{
	"{{ d | dictsort }}": "jinja has no tuples: pairs print as ['a', 2.0] (iteration is unaffected)",
	"{{ 3 // 2 }}|{{ 7 % 3 }}|{{ 2 ** 3 }}|{{ 'a' * 3 }}|{{ 7 / 2 }}|{{ 4 / 2 }}|{{ n * f }}|{{ n - 10 }}":        "int ** int is a float in jinja (8.0)",
	"{{ 1.5 | round }}|{{ 2.567 | round(2) }}|{{ -3 | abs }}|{{ 2.5 | int }}|{{ '3' | int + 1 }}|{{ 3 | float }}": "jinja applies a filter before unary minus: -3 | abs is -(abs(3))",
	"{{ n ~ '|' ~ f ~ '|' ~ x }}":                         "the ~ operator prints None as \"\" (and floats Go-style)",
	"{{ '%d items' % 3 }}|{{ '%s and %s' % ('a', 'b') }}": "no %-formatting operator on strings (the format filter works)",
	"{{ 'x'.join(['a', 'b']) }}":                          "no str.join method (the join filter works)",
}

// TestJinja2Expressions renders expressions and statements common in chat
// templates (filters, tests, slicing, string and dict methods, namespace,
// macros, loop controls) and compares each with Python jinja2 3.1.6
// configured as transformers does.
func TestJinja2Expressions(t *testing.T) {
	data, err := os.ReadFile("testdata/jinja2_expressions.json")
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Vars  json.RawMessage
		Cases []struct{ Src, Out, Error string }
	}
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	var vars map[string]json.RawMessage
	if err := json.Unmarshal(g.Vars, &vars); err != nil {
		t.Fatal(err)
	}
	// The snippets exercise jinja on structured messages (content parts,
	// extra keys). Render rebuilds "messages" the way vLLM does, so the
	// snippets read the same data from a plain variable instead.
	vars["msgs__"] = vars["messages"]
	delete(vars, "messages")
	tools := vars["tools"]
	delete(vars, "tools")
	kwargs, _ := json.Marshal(vars)
	messages := json.RawMessage(`[]`)
	asVariable := regexp.MustCompile(`\bmessages\b`)
	pass := 0
	for _, c := range g.Cases {
		got, err := func() (string, error) {
			tmpl, err := Compile(asVariable.ReplaceAllString(c.Src, "msgs__"))
			if err != nil {
				return "", err
			}
			return tmpl.Render(Input{Messages: messages, Tools: tools, Kwargs: kwargs})
		}()
		ok := err == nil && got == c.Out
		if reason, known := knownExpressionGaps[c.Src]; known {
			if ok {
				t.Errorf("known gap now matches jinja2, drop it from the list: %q (%s)", c.Src, reason)
			}
			continue
		}
		if !ok {
			t.Errorf("%q\n got: %q (err %v)\nwant: %q", c.Src, got, err, c.Out)
			continue
		}
		pass++
	}
	t.Logf("%d/%d expression snippets equal jinja2; %d known gaps", pass, len(g.Cases), len(knownExpressionGaps))
}
