package plan

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/storedchain"
	"github.com/kvmesh/kvmesh/tokenize"
)

// TestDecidePinned: a request only one replica can serve (it stores the
// response the request continues) goes there alone, whatever the filters,
// its load or the fallback say; a replica gone is a 404 naming it.
func TestDecidePinned(t *testing.T) {
	keys, _ := keysOf(longPrompt, "")
	reps := []replica{{name: "a", filter: true}, {name: "b", filter: true, holds: len(keys)}, {name: "off", offline: true}, {name: "other", models: []string{"m2"}}}
	cases := []struct {
		name, pin string
		loads     map[string]Load
		want      string // target, or the 404's text
	}{
		{name: "the pinned replica, not the warm one", pin: "a", want: "a"},
		{name: "ejected, still the only place", pin: "a", loads: map[string]Load{"a": {Ejected: true}}, want: "a"},
		{name: "gone", pin: "zz", want: `stored by replica "zz", which is no longer in the fleet`},
		{name: "offline", pin: "off", want: `stored by replica "off", which is no longer in the fleet`},
		{name: "another model's", pin: "other", want: `stored by replica "other", which does not serve model "sim"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			snap := fleetOf(t, reps, keys)
			loads := make([]Load, len(snap.Replicas))
			for name, l := range c.loads {
				loads[snap.Find(name)] = l
			}
			policy, _ := routing.New("kvaware", routing.Config{})
			in := Input{Snapshot: snap, Loads: loads, Request: completion(t, longPrompt, ""), Model: model, Now: t0,
				ModelSettings: Model{Tokenizer: tokenize.Builtin{}, Fallback: []string{"fb"}},
				Settings:      Settings{Policy: policy, MaxPrefixTokens: 1024, MaxPrefixBytes: 1 << 20, MaxAttempts: 3},
				Replica:       c.pin, StoredBy: "Response with id 'resp_x'"}
			var p Plan
			err := p.Decide(&in)
			if strings.Contains(c.want, " ") {
				var re *request.Error
				if !errors.As(err, &re) || re.Status != 404 || !strings.Contains(re.Message, c.want) || !strings.HasPrefix(re.Message, "Response with id 'resp_x'") {
					t.Fatalf("error %v, want a 404 saying %s", err, c.want)
				}
				return
			}
			if err != nil || len(p.Targets) != 1 || p.Targets[0].Name != c.want || !p.Targets[0].Picked {
				t.Fatalf("targets %+v (%v), want %s alone", p.Targets, err, c.want)
			}
		})
	}
}

// TestConvertedRequestsTokenizeAsTheirChat: a Responses and a Messages body
// are tokenized into the very prompt of the chat vLLM derives from them,
// and a follow-up of a stored response, whose prompt starts with what only
// its replica holds, is not tokenized at all.
func TestConvertedRequestsTokenizeAsTheirChat(t *testing.T) {
	chat := `{"model":"sim","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"` + longPrompt + `"}]}`
	bodies := map[request.Kind]string{
		request.Chat:      chat,
		request.Responses: `{"model":"sim","instructions":"Be brief.","input":"` + longPrompt + `"}`,
		request.Messages:  `{"model":"sim","system":"Be brief.","max_tokens":4,"messages":[{"role":"user","content":"` + longPrompt + `"}]}`,
	}
	snap := fleetOf(t, []replica{{name: "a", filter: true}}, nil)
	decide := func(body string, k request.Kind) *Plan {
		t.Helper()
		r, err := request.Parse([]byte(body), k)
		if err != nil {
			t.Fatal(err)
		}
		policy, _ := routing.New("kvaware", routing.Config{})
		p := &Plan{}
		in := Input{Snapshot: snap, Loads: make([]Load, 1), Request: r, Model: model, Now: t0,
			ModelSettings: Model{Tokenizer: tokenize.Builtin{}},
			Settings:      Settings{Policy: policy, MaxPrefixTokens: 1024, MaxPrefixBytes: 1 << 20, MaxAttempts: 3}}
		if err := p.Decide(&in); err != nil {
			t.Fatal(err)
		}
		return p
	}
	want := decide(chat, request.Chat)
	if want.Prompt.Err != nil || len(want.Request.Keys) < 4 {
		t.Fatalf("chat: %+v", want.Prompt)
	}
	for k, body := range bodies {
		p := decide(body, k)
		if p.Prompt.Tokens != want.Prompt.Tokens || p.Request.AffinityKey != want.Request.AffinityKey || len(p.Request.Keys) != len(want.Request.Keys) {
			t.Errorf("kind %d: %d tokens, affinity %x; the chat %d, %x", k, p.Prompt.Tokens, p.Request.AffinityKey, want.Prompt.Tokens, want.Request.AffinityKey)
		}
	}
	p := decide(`{"model":"sim","input":"And?","previous_response_id":"resp_1"}`, request.Responses)
	if !errors.Is(p.Prompt.Err, ErrStoredState) {
		t.Errorf("a follow-up was tokenized: %+v", p.Prompt)
	}
}

// TestSessionHint: the session a client names reaches the policy as the
// same non-zero key on every router, and its cold prompts go to its one
// home whatever their prefix; no session, no key and no home.
func TestSessionHint(t *testing.T) {
	if SessionKey("") != 0 || SessionKey("s-1") == 0 || SessionKey("s-1") != SessionKey("s-1") || SessionKey("s-1") == SessionKey("s-2") {
		t.Fatalf("keys: %x %x %x", SessionKey(""), SessionKey("s-1"), SessionKey("s-2"))
	}
	reps := []replica{{name: "a", filter: true}, {name: "b", filter: true}, {name: "c", filter: true}, {name: "d", filter: true}}
	snap := fleetOf(t, reps, nil)
	policy, _ := routing.New("kvaware", routing.Config{})
	for _, c := range []struct {
		session string
		home    bool
	}{{"agent-7", true}, {"", false}} {
		homes := map[string]bool{}
		for i := range 6 {
			in := Input{Snapshot: snap, Loads: make([]Load, len(reps)), Request: completion(t, strings.Repeat("Prompt number ", 5)+string(rune('A'+i))+longPrompt, ""),
				Model: model, Now: t0, Session: c.session, ModelSettings: Model{Tokenizer: tokenize.Builtin{}},
				Settings: Settings{Policy: policy, MaxPrefixTokens: 1024, MaxPrefixBytes: 1 << 20, MaxAttempts: 3}}
			var p Plan
			if err := p.Decide(&in); err != nil {
				t.Fatal(err)
			}
			if p.Request.Session != SessionKey(c.session) || p.Decision.SessionHome != c.home {
				t.Fatalf("session %q: key %x, home %v", c.session, p.Request.Session, p.Decision.SessionHome)
			}
			homes[p.Targets[0].Name] = true
		}
		if c.home && len(homes) != 1 {
			t.Errorf("session %q went to %v, want one home", c.session, homes)
		}
	}
}

// TestContinuedFollowUp: a follow-up whose prompt the router rebuilt
// (Input.Continued: the history's last block key, then the ids after it)
// is predicted from the pinned replica's filter as any prompt: all its
// history's blocks and those after it the filter holds, none when the
// history's last block is gone, none for another block size.
func TestContinuedFollowUp(t *testing.T) {
	ids, _ := tokenize.Builtin{}.Encode(longPrompt, true)
	keys := blockkey.Append(nil, blockkey.Seed("", ""), ids, 16)
	const history = 5 // blocks the stored conversation holds
	if len(keys) < history+3 {
		t.Fatalf("%d blocks", len(keys))
	}
	follow, err := request.Parse([]byte(`{"model":"sim","input":"And?","previous_response_id":"resp_1"}`), request.Responses)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name       string
		holds, bs  int
		wantCached int
	}{
		{"history and two blocks after it", history + 2, 16, (history + 2) * 16},
		{"the history alone", history, 16, history * 16},
		{"its last block evicted", history - 1, 16, 0},
		{"keyed by another block size", history + 2, 32, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			snap := fleetOf(t, []replica{{name: "a", filter: true, holds: c.holds}}, keys)
			policy, _ := routing.New("kvaware", routing.Config{})
			in := Input{Snapshot: snap, Loads: make([]Load, 1), Request: follow, Model: model, Now: t0,
				ModelSettings: Model{Tokenizer: tokenize.Builtin{}},
				Settings:      Settings{Policy: policy, MaxPrefixTokens: 1024, MaxPrefixBytes: 1 << 20, MaxAttempts: 3},
				Replica:       "a", StoredBy: "Response with id 'resp_x'",
				Continued: &storedchain.Continued{BlockSize: c.bs, Blocks: history, Last: keys[history-1], IDs: ids[history*16:]}}
			var p Plan
			if err := p.Decide(&in); err != nil {
				t.Fatal(err)
			}
			if got := p.Targets[0].PredictedCached; got != c.wantCached || p.Prompt.Tokens != in.Continued.Tokens() || p.Request.Keys != nil {
				t.Fatalf("predicted %d of %d tokens (keys %d), want %d of %d", got, p.Prompt.Tokens, len(p.Request.Keys), c.wantCached, in.Continued.Tokens())
			}
		})
	}
}
