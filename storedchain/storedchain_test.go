package storedchain

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/tokenize"
)

const bs = 16

var tools = `[{"type":"function","name":"read_file","description":"Read a file.","parameters":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}]`

// engineFollowUp is the chat the engine renders for a follow-up of a
// stored response whose messages were stored and whose output was output:
// construct_input_messages at 01ca842d.
func engineFollowUp(t *testing.T, stored json.RawMessage, output string, r *request.Request) []json.RawMessage {
	t.Helper()
	var prev, now []json.RawMessage
	if err := json.Unmarshal(stored, &prev); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(r.Messages, &now); err != nil {
		t.Fatal(err)
	}
	var msgs []json.RawMessage
	if len(now) > 0 && roleOf(now[0]) == "system" {
		msgs, now = append(msgs, now[0]), now[1:]
	}
	for _, m := range prev {
		if roleOf(m) != "system" {
			msgs = append(msgs, m)
		}
	}
	out, _ := json.Marshal(map[string]string{"role": "assistant", "content": output})
	return append(append(msgs, out), now...)
}

func parse(t *testing.T, body string) *request.Request {
	t.Helper()
	r, err := request.Parse([]byte(body), request.Responses)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestFollowUpsRebuildTheEnginePrompt: over a chain of stored turns (a
// task, then function outputs and user turns, as an agent sends them),
// the prompt Continue rebuilds for each follow-up is token for token the
// one the engine renders from the stored history: the history's blocks
// end at the carried key, and the ids after them are the engine's.
func TestFollowUpsRebuildTheEnginePrompt(t *testing.T) {
	models := map[string]tokenize.Model{"builtin": tokenize.Builtin{}}
	for _, name := range []string{"qwen2.5", "llama3"} {
		tk, err := tokenize.LoadDir(filepath.Join("..", "..", "shared", "tokenizers", name))
		if err != nil {
			t.Logf("%s: %v (skipped)", name, err)
			continue
		}
		models[name] = tk
	}
	instructions := strings.Repeat("You are a coding agent; read before you write. ", 9)
	for name, tk := range models {
		t.Run(name, func(t *testing.T) {
			seed := blockkey.Seed("", "")
			r := parse(t, fmt.Sprintf(`{"model":"m","instructions":%q,"tools":%s,"input":"Find the bug in main.go.","store":true}`, instructions, tools))
			_, prompt, err := tk.EncodeChat(r.ChatInput())
			if err != nil {
				t.Fatal(err)
			}
			st, err := Begin(tk, r, seed, prompt, bs)
			if err != nil {
				t.Fatal(err)
			}
			stored := r.Messages
			inputs := []string{
				`[{"type":"function_call_output","call_id":"call_1","output":"package main\n\nfunc main() {}\n"}]`,
				`[{"type":"message","role":"user","content":[{"type":"input_text","text":"Now fix it."}]}]`,
				`"Thanks, and the tests?"`,
			}
			for turn, input := range inputs {
				output := fmt.Sprintf("Turn %d: I will call read_file on main.go", turn)
				r := parse(t, fmt.Sprintf(`{"model":"m","instructions":%q,"tools":%s,"input":%s,"previous_response_id":"resp_1"}`, instructions, tools, input))
				msgs := engineFollowUp(t, stored, output, r)
				chat := r.ChatInput()
				chat.Messages, _ = json.Marshal(msgs)
				_, want, err := tk.EncodeChat(chat)
				if err != nil {
					t.Fatal(err)
				}
				c, next, err := Continue(tk, r, seed, st, []string{output}, bs)
				if err != nil {
					t.Fatalf("turn %d: %v", turn, err)
				}
				keys := blockkey.Append(nil, seed, want, bs)
				if c.Tokens() != len(want) || c.Blocks == 0 || keys[c.Blocks-1] != c.Last || !slices.Equal(c.IDs, want[c.Blocks*bs:]) {
					t.Fatalf("turn %d: rebuilt %d tokens (%d blocks, then %d ids), the engine renders %d", turn, c.Tokens(), c.Blocks, len(c.IDs), len(want))
				}
				// The state carried on names the history the next turn
				// starts with: this prompt without its generation prompt.
				chat.AddGenerationPrompt = false
				_, closed, _ := tk.EncodeChat(chat)
				if next.Tokens != len(closed) || !slices.Equal(next.Tail, closed[next.Blocks()*bs:]) || blockkey.Append(nil, seed, closed, bs)[next.Blocks()-1] != next.Last {
					t.Fatalf("turn %d: the next state names %d tokens, the history has %d", turn, next.Tokens, len(closed))
				}
				again, err := Decode(next.Encode())
				if err != nil || !slices.Equal(again.Tail, next.Tail) || again.Last != next.Last || again.Tokens != next.Tokens || again.Fingerprint != next.Fingerprint {
					t.Fatalf("turn %d: the state does not survive its encoding: %v", turn, err)
				}
				st, stored = again, chat.Messages
			}
		})
	}
}

// TestFollowUpsThatRenderOtherwiseAreRefused: changed instructions or
// tools, or a system message in the input, leave the follow-up without a
// rebuilt prompt rather than with a wrong one.
func TestFollowUpsThatRenderOtherwiseAreRefused(t *testing.T) {
	tk := tokenize.Builtin{}
	seed := blockkey.Seed("", "")
	r := parse(t, `{"model":"m","instructions":"Be brief.","input":"Hello there, agent.","store":true}`)
	_, prompt, _ := tk.EncodeChat(r.ChatInput())
	st, err := Begin(tk, r, seed, prompt, bs)
	if err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{
		`{"model":"m","input":"And then?","previous_response_id":"resp_1"}`,
		`{"model":"m","instructions":"Be long.","input":"And then?","previous_response_id":"resp_1"}`,
		`{"model":"m","instructions":"Be brief.","tools":` + tools + `,"input":"And then?","previous_response_id":"resp_1"}`,
		`{"model":"m","instructions":"Be brief.","input":[{"type":"message","role":"system","content":"Mind the tests."},{"type":"message","role":"user","content":"Go."}],"previous_response_id":"resp_1"}`,
		`{"model":"m","instructions":"Be brief.","input":"And then?","previous_response_id":"resp_1","cache_salt":"x"}`,
	} {
		r := parse(t, body)
		if _, _, err := Continue(tk, r, blockkey.Seed("", r.CacheSalt), st, []string{"Hi."}, bs); err == nil {
			t.Errorf("%s: rebuilt", body)
		}
	}
	r = parse(t, `{"model":"m","instructions":"Be brief.","input":"And then?","previous_response_id":"resp_1"}`)
	if _, _, err := Continue(tk, r, seed, st, []string{"Hi."}, 32); err == nil {
		t.Error("rebuilt for another block size")
	}
}

func FuzzDecode(f *testing.F) {
	tail := State{Fingerprint: 7, LastRole: Tool, BlockSize: 16, Tokens: 35, Last: 9, Tail: []uint32{1, 1 << 20, 3}}
	f.Add(tail.Encode())
	short := State{Fingerprint: 1, LastRole: User, BlockSize: 16, Tokens: 5, Tail: []uint32{1, 2, 3, 4, 5}}
	f.Add(short.Encode())
	f.Add([]byte{1})
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := Decode(b)
		if err != nil {
			return
		}
		if len(s.Tail) != s.Tokens%s.BlockSize {
			t.Fatalf("%x: %d tail tokens for %d tokens of %d-token blocks", b, len(s.Tail), s.Tokens, s.BlockSize)
		}
		again, err := Decode(s.Encode())
		if err != nil || !slices.Equal(again.Tail, s.Tail) || again.Last != s.Last || again.Tokens != s.Tokens || again.Fingerprint != s.Fingerprint || again.LastRole != s.LastRole {
			t.Fatalf("%x decodes to %+v, which re-encodes to %+v (%v)", b, s, again, err)
		}
	})
}
