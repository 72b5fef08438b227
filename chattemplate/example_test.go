package chattemplate_test

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvmesh/kvmesh/chattemplate"
)

func Example() {
	// Compile once per model (tokenizer_config.json "chat_template"), then
	// render every request; Render is safe for concurrent use.
	tmpl, err := chattemplate.Compile("{% for m in messages %}{{ '<|' + m.role + '|>' + m.content | trim }}\n{% endfor %}" +
		"{% if tools %}{{ tools[0] | tojson }}\n{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
	if err != nil {
		panic(err)
	}
	prompt, err := tmpl.Render(chattemplate.Input{
		Messages:            json.RawMessage(`[{"role":"user","content":"  Grüezi! "}]`),
		Tools:               json.RawMessage(`[{"type":"function","function":{"name":"weather","parameters":{"city":"string","days":1.0}}}]`),
		AddGenerationPrompt: true,
	})
	if err != nil {
		panic(err)
	}
	fmt.Println(prompt)

	// A template's raise_exception surfaces as *TemplateError.
	strict, _ := chattemplate.Compile(`{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}`)
	_, err = strict.Render(chattemplate.Input{Messages: json.RawMessage(`[{"role":"assistant","content":"hi"}]`)})
	var te *chattemplate.TemplateError
	fmt.Println(errors.As(err, &te), te.Message)
	// Output:
	// <|user|>Grüezi!
	// {"type": "function", "function": {"name": "weather", "description": null, "parameters": {"city": "string", "days": 1.0}}}
	// <|assistant|>
	// true first message must be from the user
}
