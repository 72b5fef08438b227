package plan

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/tokenize"
)

// TestReusedPromptBufferKeepsIdsExact encodes chats of every size through
// one Plan, whose prompt buffer each reuses and some outgrow, with
// media (the retried render) and tools (jinja's path) among them: the ids
// are always those of a render into a new prompt.
func TestReusedPromptBufferKeepsIdsExact(t *testing.T) {
	if raceEnabled {
		// Loading two real tokenizers takes seconds under the race
		// detector, and one Plan on one goroutine has no race to find.
		t.Skip("no concurrency here; run without -race")
	}
	for _, model := range []string{"llama3", "qwen2.5"} {
		tk := realTokenizer(t, model)
		if tk == nil {
			t.Skip("real tokenizer files not found: they live in ../shared/tokenizers beside the repository")
		}
		var pl Plan
		in := Input{ModelSettings: Model{Tokenizer: tk}}
		r := rand.New(rand.NewPCG(5, 6))
		words := []string{"hello", " ", "world", "\n", "é", "日本", "<|eot_id|>", "  ", "\u00a0", "tool"}
		grew := 0
		for i := range 300 {
			var msgs []string
			for range 1 + r.IntN(5) {
				var b strings.Builder
				for range r.IntN(1 + r.IntN(3)*2000) {
					b.WriteString(words[r.IntN(len(words))])
				}
				content, _ := json.Marshal(b.String())
				role := []string{"system", "user", "assistant", "tool"}[r.IntN(4)]
				msgs = append(msgs, fmt.Sprintf(`{"role":%q,"content":%s}`, role, content))
			}
			if r.IntN(8) == 0 {
				msgs = append(msgs, `{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}`)
			}
			p := &request.Request{Kind: request.Chat}
			in.Request = p
			p.Messages = json.RawMessage("[" + strings.Join(msgs, ",") + "]")
			if r.IntN(6) == 0 {
				p.Tools = json.RawMessage(`[{"type":"function","function":{"name":"f"}}]`)
			}
			before := cap(pl.promptBuf)
			pre, _, err := pl.encode(&in)
			ids := pre.IDs
			if cap(pl.promptBuf) > before && before > 0 {
				grew++
			}
			chat := tokenize.Chat{Messages: p.Messages, Tools: p.Tools, AddGenerationPrompt: true}
			_, want, werr := tk.EncodeChat(chat)
			if k, media := tokenize.MediaMessage(werr); media && k > 0 {
				chat.Messages, chat.AddGenerationPrompt = request.LeadingElements(p.Messages, k), false
				_, want, werr = tk.EncodeChat(chat)
			}
			if fmt.Sprint(err) != fmt.Sprint(werr) || !slices.Equal(ids, want) {
				t.Fatalf("%s case %d: %v, %d ids; want %v, %d ids", model, i, err, len(ids), werr, len(want))
			}
		}
		if grew == 0 {
			t.Errorf("%s: the prompt buffer never grew", model)
		}
	}
}
