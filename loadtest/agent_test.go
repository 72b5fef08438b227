package loadtest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
)

var testAgent = workload.AgentParams{ConversationRate: 3, MinTurns: 3, MaxTurns: 4, Agents: 1, InstructionTokens: 300,
	TaskMedian: 20, ToolOutputMedian: 40, MaxToolOutput: 200, OutputTokens: 4, StoredShare: 0.5, ThinkTime: 200 * time.Millisecond}

func TestBuildTurnLaysOutWhatTheEngineRenders(t *testing.T) {
	tools := json.RawMessage(`[{"type":"function","name":"read_file","parameters":{"type":"object"}}]`)
	call := json.RawMessage(`{"arguments":"{}","call_id":"c1","name":"read_file","type":"function_call"}`)
	out := json.RawMessage(`{"call_id":"c1","output":"file text","type":"function_call_output"}`)
	task := json.RawMessage(`{"content":"fix it","role":"user","type":"message"}`)
	turn0 := &workload.AgentTurn{Conversation: "a0", Stored: true, Instructions: "be brief", Tools: tools, Input: []json.RawMessage{task}}
	first, err := buildTurn("sim", turn0, 8, nil)
	if err != nil {
		t.Fatal(err)
	}
	const system, user = `{"role":"system","content":"be brief"}`, `{"role":"user","content":"fix it"}`
	if got := fmt.Sprintf("%s", first.messages); got != fmt.Sprintf("%s", []string{system, user}) || first.followUp {
		t.Fatalf("turn 0 messages %s", got)
	}
	prev := &conversation{chat: first.messages, items: first.items, id: "resp_kvmX_1", answer: "calling"}
	cases := []struct {
		stored              bool
		wantBody, wantMsgs  string
		followUp            bool
		wantChatToolsPrefix string
	}{
		// A follow-up sends only its instructions and the new items, and
		// names the stored response; the engine renders the instructions,
		// the stored messages less their system message, the stored
		// answer, then the new input on its own.
		{true, `{"input":[` + string(call) + `,` + string(out) + `],"instructions":"be brief","max_output_tokens":8,"model":"sim","previous_response_id":"resp_kvmX_1","store":true,"stream":true,"tools":` + string(tools) + `}`,
			`[` + system + ` ` + user + ` {"content":"calling","role":"assistant"} {"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"read_file","arguments":"{}"},"type":"function"}]} {"role":"tool","content":"file text","tool_call_id":"c1"}]`,
			true, `[{"type":"function","function":{`},
		// The whole history: the answer as an output message, which the
		// function call after it joins.
		{false, `{"input":[` + string(task) + `,{"content":[{"text":"calling","type":"output_text"}],"role":"assistant","type":"message"},` + string(call) + `,` + string(out) + `],"instructions":"be brief","max_output_tokens":8,"model":"sim","store":false,"stream":true,"tools":` + string(tools) + `}`,
			`[` + system + ` ` + user + ` {"role":"assistant","content":"calling","tool_calls":[{"id":"c1","function":{"name":"read_file","arguments":"{}"},"type":"function"}]} {"role":"tool","content":"file text","tool_call_id":"c1"}]`,
			false, `[{"type":"function","function":{`},
	}
	for _, c := range cases {
		turn := &workload.AgentTurn{Conversation: "a0", Turn: 1, Stored: c.stored, Instructions: "be brief", Tools: tools, Input: []json.RawMessage{call, out}}
		a, err := buildTurn("sim", turn, 8, prev)
		if err != nil {
			t.Fatal(err)
		}
		if string(a.responses) != c.wantBody || a.followUp != c.followUp {
			t.Errorf("stored %v: body\n%s\nwant\n%s", c.stored, a.responses, c.wantBody)
		}
		if got := fmt.Sprintf("%s", a.messages); got != c.wantMsgs {
			t.Errorf("stored %v: messages\n%s\nwant\n%s", c.stored, got, c.wantMsgs)
		}
		var chat struct {
			Messages []json.RawMessage `json:"messages"`
			Tools    json.RawMessage   `json:"tools"`
		}
		if err := json.Unmarshal(a.chat, &chat); err != nil || fmt.Sprintf("%s", chat.Messages) != c.wantMsgs ||
			!bytes.HasPrefix(chat.Tools, []byte(c.wantChatToolsPrefix)) {
			t.Errorf("stored %v: chat body %s (%v)", c.stored, a.chat, err)
		}
	}
}

// TestAgentAgainstEnginesim sends the same agent conversations to one real
// enginesim through the Responses API and as chat completions: every turn
// succeeds, follow-ups find their stored responses, both APIs render the
// same prompts, and later turns are served from cache.
func TestAgentAgainstEnginesim(t *testing.T) {
	base := startEnginesim(t)
	w, err := workload.Agent(testAgent, 1, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	prompts := map[string]int{}
	for _, chat := range []bool{false, true} {
		c := NewClient("sim")
		c.Chat = chat
		res := Replay(context.Background(), c, w, ReplayOptions{Targets: []string{base}, TimeScale: 0.05, Drain: 20 * time.Second})
		followUps := 0
		for i, r := range res.Records {
			q := w.Requests[i]
			if !r.OK() || r.TTFT <= 0 || r.OutputTokens != 4 {
				t.Fatalf("chat %v: %s: %+v", chat, r.Key, r)
			}
			if r.FollowUp {
				followUps++
			}
			if r.FollowUp != (!chat && q.Agent.Stored && q.Agent.Turn > 0) {
				t.Fatalf("chat %v: %s follow-up %v", chat, r.Key, r.FollowUp)
			}
			if q.Agent.Turn > 0 && r.ActualCached < 300 {
				t.Fatalf("chat %v: %s: %d cached tokens: the history was not reused", chat, r.Key, r.ActualCached)
			}
			if n, ok := prompts[r.Key]; ok && n != r.PromptTokens {
				t.Fatalf("%s: %d prompt tokens as chat, %d through /v1/responses", r.Key, r.PromptTokens, n)
			}
			prompts[r.Key] = r.PromptTokens
		}
		if followUps == 0 && !chat {
			t.Fatal("no follow-up sent")
		}
	}
}

func TestAgentTurnsAfterAFailedOneAreNotSent(t *testing.T) {
	w, err := workload.Agent(testAgent, 1, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	base := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	res := Replay(context.Background(), NewClient("sim"), w, ReplayOptions{Targets: []string{base}, TimeScale: 0.01, Drain: 5 * time.Second})
	for i, r := range res.Records {
		want := "connect:"
		if w.Requests[i].Agent.Turn > 0 {
			want = "not sent: the previous turn failed"
		}
		if !strings.HasPrefix(r.Err, want) || r.StoredMissing {
			t.Fatalf("%s: %+v, want %q", r.Key, r, want)
		}
	}
}

const responsesOK = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_kvmA_1\",\"usage\":null},\"sequence_number\":0}\n\n" +
	"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\" a\",\"sequence_number\":1}\n\n" +
	"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\" b\",\"sequence_number\":2}\n\n" +
	"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_kvmA_1\",\"usage\":{\"input_tokens\":40,\"input_tokens_details\":{\"cached_tokens\":32},\"output_tokens\":2}},\"sequence_number\":3}\n\n"

func TestReadResponsesStream(t *testing.T) {
	cases := []struct {
		name, body, err, id, text string
		prompt, out, cached       int
		ttft                      bool
	}{
		{"ok", responsesOK, "", "resp_kvmA_1", " a b", 40, 2, 32, true},
		{"unterminated last line", strings.TrimSuffix(responsesOK, "\n\n"), "", "resp_kvmA_1", " a b", 40, 2, 32, true},
		{"no completed", responsesOK[:strings.Index(responsesOK, "event: response.completed")], "stream ended without response.completed", "", " a b", 7, 0, 0, true},
		{"error event", "event: error\ndata: {\"type\":\"error\",\"code\":\"upstream_error\",\"message\":\"engine died\"}\n\n", "stream error: engine died", "", "", 7, 0, 0, false},
		{"no output", "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\"}}\n\n", "stream had no output", "r", "", 7, 0, 0, false},
		{"garbage", "data: {nope\n\n", "stream: bad event", "", "", 7, 0, 0, false},
	}
	for _, c := range cases {
		rec := report.Record{PromptTokens: 7}
		var text strings.Builder
		id := readResponsesStream(context.Background(), strings.NewReader(c.body), time.Now(), &rec, &text)
		if !strings.HasPrefix(rec.Err, c.err) || (c.err == "") != (rec.Err == "") {
			t.Errorf("%s: err %q, want %q", c.name, rec.Err, c.err)
		}
		if id != c.id || text.String() != c.text || rec.PromptTokens != c.prompt || rec.OutputTokens != c.out || rec.ActualCached != c.cached || (rec.TTFT > 0) != c.ttft {
			t.Errorf("%s: id %q text %q record %+v", c.name, id, text.String(), rec)
		}
	}
}

func FuzzReadResponsesStream(f *testing.F) {
	f.Add([]byte(responsesOK))
	f.Add([]byte("data: {\"type\":\"response.completed\",\"response\":null}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var rec report.Record
		var text strings.Builder
		readResponsesStream(context.Background(), bytes.NewReader(data), time.Now(), &rec, &text)
		if rec.Err == "" && rec.TTFT <= 0 {
			t.Fatalf("success without output: %+v", rec)
		}
	})
}
