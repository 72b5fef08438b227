package workload

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"
)

func TestAgentTurnsChainToolCalls(t *testing.T) {
	p := AgentParams{ConversationRate: 4, MinTurns: 2, MaxTurns: 5, Agents: 2, InstructionTokens: 100,
		TaskMedian: 20, ToolOutputMedian: 30, MaxToolOutput: 200, OutputTokens: 4, StoredShare: 0.5, ThinkTime: time.Second}
	w, err := Agent(p, 7, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	again, err := Agent(p, 7, 10*time.Second)
	if err != nil || !reflect.DeepEqual(w, again) {
		t.Fatalf("not deterministic per seed: %v", err)
	}
	type item struct {
		Type, Role, CallID, Output string
		ID                         string `json:"call_id"`
	}
	last := map[string]Request{}
	stored := map[bool]int{}
	for _, r := range w.Requests {
		a := r.Agent
		if a == nil || r.MaxTokens != 4 {
			t.Fatalf("%s: %+v", r.Key, r)
		}
		prev, seen := last[a.Conversation]
		switch {
		case a.Turn == 0:
			stored[a.Stored]++
			var it item
			if seen || r.After != "" || len(a.Input) != 1 || json.Unmarshal(a.Input[0], &it) != nil || it.Type != "message" || it.Role != "user" {
				t.Fatalf("%s opens with %s (after %q)", r.Key, a.Input, r.After)
			}
		case !seen || r.After != prev.Key || a.Turn != prev.Agent.Turn+1 || a.Stored != prev.Agent.Stored || r.At <= prev.At:
			t.Fatalf("%s follows %q, want %q", r.Key, r.After, prev.Key)
		default:
			var call, out item
			if len(a.Input) != 2 || json.Unmarshal(a.Input[0], &call) != nil || json.Unmarshal(a.Input[1], &out) != nil ||
				call.Type != "function_call" || out.Type != "function_call_output" || call.ID == "" || call.ID != out.ID {
				t.Fatalf("%s adds %s, want a function call and its output", r.Key, a.Input)
			}
			if r.PromptTokens <= prev.PromptTokens {
				t.Fatalf("%s: %d prompt tokens after %d: the history does not grow", r.Key, r.PromptTokens, prev.PromptTokens)
			}
		}
		last[a.Conversation] = r
	}
	if stored[true] == 0 || stored[false] == 0 {
		t.Fatalf("conversations stored/not: %v, want both", stored)
	}
	if _, err := Agent(AgentParams{}, 1, time.Second); err == nil {
		t.Fatal("zero parameters accepted")
	}
}
