package plan

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/chattemplate"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

const model = "sim"

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

// longPrompt is long enough to fill several 16-token blocks.
var longPrompt = strings.Repeat("The quick brown fox jumps over the lazy dog. ", 20)

// replica is a fleet member as a test declares it.
type replica struct {
	name     string
	models   []string
	static   bool
	offline  bool
	filter   bool // a sidecar feeds it, with a filter
	holds    int  // how many of the prompt's leading blocks its filter holds
	waiting  int
	url      string
	others   int // in-flight requests other routers reported
	adapter  string
	oldState bool // its sidecar fell silent (stale)
	role     fleet.KVRole
	kvUsage  float64
}

// fleetOf builds the snapshot the planner reads, as gossip would fill the
// table, with holders' filters keyed for keys.
func fleetOf(t testing.TB, reps []replica, keys []uint64) *fleet.Snapshot {
	t.Helper()
	table := fleet.NewTable(fleet.TableConfig{StaleAfter: time.Minute, DropAfter: time.Hour})
	for _, r := range reps {
		models := r.models
		if models == nil && !r.static {
			models = []string{model}
		}
		url := r.url
		if url == "" {
			url = "http://127.0.0.1:1"
		}
		if r.static {
			table.AddStatic(r.name, url, models)
			continue
		}
		seen := t0
		if r.oldState {
			seen = t0.Add(-2 * time.Minute)
		}
		table.Upsert(fleet.Info{Name: r.name, Models: models, URL: url, Protocol: fleet.ProtocolVLLM, KVEvents: r.filter, BlockSize: 16, KVRole: r.role}, seen)
		table.SetLoad(r.name, fleet.Load{Waiting: r.waiting, OthersInflightRequests: r.others, KVUsage: r.kvUsage}, !r.offline, seen)
		if r.filter {
			f := bloom.NewFilter(1024, 0.001)
			for _, k := range keys[:r.holds] {
				f.Add(k)
			}
			table.SetFilter(r.name, f, 1, r.holds, seen)
		}
	}
	table.Expire(t0)
	return table.Snapshot()
}

// completion is a parsed completion of prompt.
func completion(t *testing.T, prompt, extra string) *request.Request {
	t.Helper()
	q, _ := json.Marshal(prompt)
	r, err := request.Parse([]byte(`{"model":"`+model+`","prompt":`+string(q)+extra+`}`), request.Completion)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// keysOf are the block keys the planner computes for prompt (unsalted,
// no adapter, special tokens added).
func keysOf(prompt, adapter string) ([]uint64, int) {
	ids, _ := tokenize.Builtin{}.Encode(prompt, true)
	return blockkey.Append(nil, blockkey.Seed(adapter, ""), ids, 16), len(ids)
}

// want is a target as a case expects it.
type want struct {
	name    string
	mode    routing.Mode
	cached  int
	picked  bool
	teaches bool
}

func got(p *Plan) []want {
	out := make([]want, len(p.Targets))
	for i, t := range p.Targets {
		out[i] = want{t.Name, t.Mode, t.PredictedCached, t.Picked, t.Teaches}
	}
	return out
}

// TestDecide covers each decision the gateway makes on a request: the
// targets, in order, with their modes, predicted cache hits, pick and
// whether they teach the cost model, or the error to answer.
func TestDecide(t *testing.T) {
	keys, promptTokens := keysOf(longPrompt, "")
	loraKeys, _ := keysOf(longPrompt, "sql-lora")
	full := len(keys) * 16
	three := []replica{{name: "a", filter: true}, {name: "b", filter: true, holds: len(keys)}, {name: "c", filter: true}}
	cases := []struct {
		name     string
		reps     []replica
		keys     []uint64 // what holders' filters are keyed with (default keys)
		loads    map[string]Load
		req      *request.Request
		model    Model
		attempts int
		want     []want
		status   int // an error's status instead of targets
		check    func(t *testing.T, p *Plan)
	}{
		{name: "selection follows the filter", reps: three, req: completion(t, longPrompt, ""),
			want: []want{{"b", routing.ModePrefix, full, true, true}, {"a", routing.ModeBalance, 0, false, false}, {"c", routing.ModeBalance, 0, false, false}},
			check: func(t *testing.T, p *Plan) {
				if p.Prompt.Tokens != promptTokens || p.Targets[0].Uncached != promptTokens-full || p.Targets[1].Uncached != promptTokens {
					t.Errorf("prompt %d tokens, uncached %d/%d", p.Prompt.Tokens, p.Targets[0].Uncached, p.Targets[1].Uncached)
				}
				if !p.Targets[0].PrefixAware || p.Targets[0].FilterMatched != full || p.Request.BlockSize != 16 || len(p.Request.Keys) != len(keys) {
					t.Errorf("pick %+v, request %+v", p.Targets[0], p.Request)
				}
			}},
		{name: "a salt matches no filter", reps: three, req: completion(t, longPrompt, `,"cache_salt":"tenant-2"`),
			check: func(t *testing.T, p *Plan) {
				for _, tg := range p.Targets {
					if tg.PredictedCached != 0 || tg.Mode == routing.ModePrefix {
						t.Errorf("salted prompt matched: %+v", tg)
					}
				}
			}},
		{name: "max attempts bound the replicas, the fallback comes after them", reps: three, req: completion(t, longPrompt, ""),
			model: Model{Fallback: []string{"backup"}}, attempts: 2,
			want: []want{{"b", routing.ModePrefix, full, true, true}, {"a", routing.ModeBalance, 0, false, false}, {"backup", routing.ModeFallback, 0, false, false}}},
		{name: "an ejected replica is left out", reps: three, loads: map[string]Load{"b": {Ejected: true}}, req: completion(t, longPrompt, ""),
			check: func(t *testing.T, p *Plan) {
				if len(p.Targets) != 2 || p.Targets[0].Name == "b" || p.Targets[1].Name == "b" {
					t.Errorf("targets %v", got(p))
				}
			}},
		{name: "every replica ejected: all tried all the same", reps: three,
			loads: map[string]Load{"a": {Ejected: true}, "b": {Ejected: true}, "c": {Ejected: true}}, req: completion(t, longPrompt, ""),
			check: func(t *testing.T, p *Plan) {
				if len(p.Targets) != 3 || p.Targets[0].Name != "b" {
					t.Errorf("targets %v", got(p))
				}
			}},
		{name: "an unusable URL is skipped and reported", reps: []replica{{name: "a", url: "ftp://x"}, {name: "b"}},
			loads: map[string]Load{"a": {Unusable: true}}, req: completion(t, longPrompt, ""),
			check: func(t *testing.T, p *Plan) {
				if len(p.Targets) != 1 || p.Targets[0].Name != "b" || len(p.Unusable) != 1 || p.Unusable[0] != 0 {
					t.Errorf("targets %v, unusable %v", got(p), p.Unusable)
				}
			}},
		{name: "load steers a cold prompt's runners-up", reps: []replica{{name: "a", waiting: 5}, {name: "b"}}, req: completion(t, "hi", ""),
			loads: map[string]Load{"b": {Requests: 9}},
			check: func(t *testing.T, p *Plan) {
				for i, c := range p.Candidates {
					want := map[string]int{"a": 0, "b": 9}[c.Name]
					if c.InflightRequests != want || (c.Name == "a") != (c.Waiting == 5) {
						t.Errorf("candidate %d: %+v", i, c)
					}
				}
			}},
		{name: "others' in-flight work adds to this router's", reps: []replica{{name: "a", others: 4}}, loads: map[string]Load{"a": {Requests: 2, PrefillTokens: 7}},
			req: completion(t, "hi", ""),
			check: func(t *testing.T, p *Plan) {
				if c := p.Candidates[0]; c.InflightRequests != 6 || c.PendingPrefillTokens != 7 {
					t.Errorf("candidate %+v", c)
				}
			}},
		{name: "no replica online: the fallback takes it", reps: []replica{{name: "off", offline: true, filter: true}}, req: completion(t, "hello", ""),
			model: Model{Fallback: []string{"backup"}},
			want:  []want{{"backup", routing.ModeFallback, 0, false, false}},
			check: func(t *testing.T, p *Plan) {
				if p.Decision.Reason != "no replica online" || p.Targets[0].Fallback != 0 || p.Targets[0].Replica != -1 {
					t.Errorf("decision %+v, target %+v", p.Decision, p.Targets[0])
				}
			}},
		{name: "no replica online, no fallback: 503", reps: []replica{{name: "off", offline: true}}, req: completion(t, "hello", ""), status: 503},
		{name: "a model nobody serves: 404", reps: three, req: completion(t, "hello", ""), model: Model{}, status: 404,
			check: nil},
		{name: "stale replicas only: tried by load, teaching nothing", reps: []replica{{name: "quiet", offline: true, oldState: true, filter: true, holds: len(keys)}},
			req:  completion(t, longPrompt, ""),
			want: []want{{"quiet", routing.ModeCold, 0, true, false}},
			check: func(t *testing.T, p *Plan) {
				if !p.StaleOnly || !p.Targets[0].Stale || p.Targets[0].PrefixAware {
					t.Errorf("plan %+v", p.Targets[0])
				}
			}},
		{name: "a silent sidecar's replica is routed by load", reps: []replica{{name: "quiet", oldState: true, filter: true, holds: len(keys)}},
			req: completion(t, longPrompt, ""),
			check: func(t *testing.T, p *Plan) {
				if tg := p.Targets[0]; p.StaleOnly || !tg.Stale || tg.PrefixAware || tg.Teaches || tg.PredictedCached != 0 {
					t.Errorf("target %+v", tg)
				}
			}},
		{name: "spill: the fallback first, the replica behind it", reps: []replica{{name: "e1", filter: true, waiting: 64}},
			req: completion(t, longPrompt, ""), model: Model{Fallback: []string{"backup"}, SpillAfter: 200 * time.Millisecond},
			want: []want{{"backup", routing.ModeFallback, 0, false, false}, {"e1", routing.ModeCold, 0, true, true}},
			check: func(t *testing.T, p *Plan) {
				if !p.Spilled || p.Decision.Reason != "spilled to the fallback: predicted ttft over spill_after" {
					t.Errorf("spilled %v, reason %q", p.Spilled, p.Decision.Reason)
				}
			}},
		{name: "no spill on a quiet fleet", reps: []replica{{name: "e1", filter: true}},
			req: completion(t, longPrompt, ""), model: Model{Fallback: []string{"backup"}, SpillAfter: 200 * time.Millisecond},
			want: []want{{"e1", routing.ModeCold, 0, true, true}, {"backup", routing.ModeFallback, 0, false, false}}},
		{name: "an adapter goes only to its replicas, keyed by its name, costed as its base",
			reps: []replica{{name: "base-only", filter: true, holds: len(keys)}, {name: "with-lora", models: []string{model, "sql-lora"}, filter: true, holds: len(keys)}},
			keys: loraKeys,
			req:  withModel(completion(t, longPrompt, ""), "sql-lora"), model: Model{Adapter: "sql-lora", Base: model},
			want: []want{{"with-lora", routing.ModePrefix, full, true, true}},
			check: func(t *testing.T, p *Plan) {
				if p.Request.Model != model {
					t.Errorf("costed as %q", p.Request.Model)
				}
			}},
		{name: "static upstreams without models serve any model", reps: []replica{{name: "s1", static: true}},
			req:  completion(t, "hello", ""),
			want: []want{{"s1", routing.ModeStatic, 0, true, true}}},
		{name: "a tokenizer failure routes by load", reps: three, req: chat(t, `[{"role":"user","content":"hi"}]`),
			model: Model{Tokenizer: brokenTokenizer{}},
			check: func(t *testing.T, p *Plan) {
				if p.Prompt.Err == nil || p.Prompt.Tokens != 0 || p.Decision.Mode != routing.ModeBalance {
					t.Errorf("prompt %+v, mode %s", p.Prompt, p.Decision.Mode)
				}
				for _, tg := range p.Targets {
					if tg.Teaches || tg.PrefixAware || tg.Mode != routing.ModeBalance {
						t.Errorf("target %+v", tg)
					}
				}
			}},
		{name: "a tokenizer panic is an error like another", reps: three, req: chat(t, `[{"role":"user","content":"hi"}]`),
			model: Model{Tokenizer: panickingTokenizer{}},
			check: func(t *testing.T, p *Plan) {
				var tp *TokenizerPanic
				if !errors.As(p.Prompt.Err, &tp) || tp.Value != "boom" || len(tp.Stack) == 0 || p.Prompt.Err.Error() != "tokenizer panic: boom" {
					t.Errorf("prompt %+v", p.Prompt)
				}
			}},
		{name: "no tokenizer for a chat: load only", reps: three, req: chat(t, `[{"role":"user","content":"hi"}]`),
			check: func(t *testing.T, p *Plan) {
				if !errors.Is(p.Prompt.Err, ErrNoTokenizer) || p.Decision.Mode != routing.ModeBalance {
					t.Errorf("prompt %+v, mode %s", p.Prompt, p.Decision.Mode)
				}
			}},
		{name: "a passthrough endpoint: load only", reps: three, req: passthrough(t),
			check: func(t *testing.T, p *Plan) {
				if !errors.Is(p.Prompt.Err, ErrLoadOnly) || len(p.Targets) != 3 {
					t.Errorf("prompt %+v, %d targets", p.Prompt, len(p.Targets))
				}
			}},
		{name: "media: routed on the text before it, teaching nothing",
			reps:  []replica{{name: "a", filter: true}, {name: "b", filter: true, holds: len(keys)}},
			req:   chat(t, `[{"role":"user","content":`+quote(longPrompt)+`},{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]`),
			model: Model{Tokenizer: mediaTokenizer{}},
			want:  []want{{"b", routing.ModePrefix, full, true, false}, {"a", routing.ModeBalance, 0, false, false}},
			check: func(t *testing.T, p *Plan) {
				if !p.Prompt.MediaPrefix || !p.Request.PromptContinues {
					t.Errorf("prompt %+v", p.Prompt)
				}
			}},
		{name: "media first: nothing to match, load only",
			reps:  []replica{{name: "a", filter: true}},
			req:   chat(t, `[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]`),
			model: Model{Tokenizer: mediaTokenizer{}},
			want:  []want{{"a", routing.ModeBalance, 0, true, false}},
			check: func(t *testing.T, p *Plan) {
				if p.Prompt.Err == nil || p.Prompt.Tokens != 0 {
					t.Errorf("prompt %+v", p.Prompt)
				}
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			k := keys
			if c.keys != nil {
				k = c.keys
			}
			snap := fleetOf(t, c.reps, k)
			loads := make([]Load, len(snap.Replicas))
			for name, l := range c.loads {
				loads[snap.Find(name)] = l
			}
			policy, err := routing.New("kvaware", routing.Config{})
			if err != nil {
				t.Fatal(err)
			}
			ms := c.model
			if ms.Tokenizer == nil && c.req.Kind == request.Completion {
				ms.Tokenizer = tokenize.Builtin{}
			}
			attempts := c.attempts
			if attempts == 0 {
				attempts = 3
			}
			name := c.req.Model
			if c.status == 404 {
				name = "nobody-serves-this"
			}
			in := Input{Snapshot: snap, Loads: loads, Request: c.req, Model: name, ModelSettings: ms, Now: t0,
				Settings: Settings{Policy: policy, MaxPrefixTokens: tokenize.DefaultMaxPrefixTokens, MaxPrefixBytes: tokenize.DefaultMaxPrefixBytes, MaxAttempts: attempts}}
			var p Plan
			err = p.Decide(&in)
			if c.status != 0 {
				var re *request.Error
				if !errors.As(err, &re) || re.Status != c.status {
					t.Fatalf("error %v, want a %d", err, c.status)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.want != nil && fmt.Sprint(got(&p)) != fmt.Sprint(c.want) {
				t.Errorf("targets\n got %v\nwant %v", got(&p), c.want)
			}
			if c.check != nil {
				c.check(t, &p)
			}
		})
	}
}

// TestDecideReusesItsPlan: a Plan decides request after request without
// growing, and a decision never lists more targets than are tried.
func TestDecideReusesItsPlan(t *testing.T) {
	reps := make([]replica, 50)
	for i := range reps {
		reps[i] = replica{name: fmt.Sprintf("r%02d", i), filter: true}
	}
	keys, _ := keysOf(longPrompt, "")
	snap := fleetOf(t, reps, keys)
	policy, _ := routing.New("kvaware", routing.Config{})
	req := completion(t, longPrompt, "")
	in := Input{Snapshot: snap, Loads: make([]Load, len(snap.Replicas)), Request: req, Model: model, Now: t0,
		ModelSettings: Model{Tokenizer: tokenize.Builtin{}, Fallback: []string{"backup"}},
		Settings:      Settings{Policy: policy, MaxPrefixTokens: 1024, MaxPrefixBytes: 1 << 20, MaxAttempts: 3}}
	var p Plan
	if err := p.Decide(&in); err != nil {
		t.Fatal(err)
	}
	if len(p.Targets) != 4 || cap(p.Targets) > 8 {
		t.Fatalf("%d targets (capacity %d), want 3 replicas and the fallback", len(p.Targets), cap(p.Targets))
	}
	allocs := testing.AllocsPerRun(100, func() {
		if err := p.Decide(&in); err != nil {
			t.Fatal(err)
		}
	})
	// What remains is the tokenizer's own (Builtin's ids).
	if allocs > 2 {
		t.Errorf("a reused plan allocates %.0f times a decision", allocs)
	}
}

func withModel(r *request.Request, m string) *request.Request { r.Model = m; return r }

func quote(s string) string { b, _ := json.Marshal(s); return string(b) }

func chat(t *testing.T, messages string) *request.Request {
	t.Helper()
	r, err := request.Parse([]byte(`{"model":"`+model+`","messages":`+messages+`}`), request.Chat)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func passthrough(t *testing.T) *request.Request {
	t.Helper()
	r, err := request.ParsePassthrough([]byte(`{"model":"`+model+`","input":"x"}`), "")
	if err != nil {
		t.Fatal(err)
	}
	return r
}

type brokenTokenizer struct{}

func (brokenTokenizer) Encode(string, bool) ([]uint32, error) {
	return nil, errors.New("tokenizer down")
}
func (brokenTokenizer) EncodeChat(tokenize.Chat) (string, []uint32, error) {
	return "", nil, errors.New("tokenizer down")
}

type panickingTokenizer struct{}

func (panickingTokenizer) Encode(string, bool) ([]uint32, error)              { panic("boom") }
func (panickingTokenizer) EncodeChat(tokenize.Chat) (string, []uint32, error) { panic("boom") }

// mediaTokenizer renders a chat as the concatenation of its text contents,
// tokenized as Builtin does a completion (special tokens added), and fails
// as a chat template does on the first message holding an image.
type mediaTokenizer struct{}

func (mediaTokenizer) Encode(text string, special bool) ([]uint32, error) {
	return tokenize.Builtin{}.Encode(text, special)
}

func (mediaTokenizer) EncodeChat(c tokenize.Chat) (string, []uint32, error) {
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(c.Messages, &msgs); err != nil {
		return "", nil, err
	}
	var text string
	for i, m := range msgs {
		if bytes.Contains(m.Content, []byte("image_url")) {
			return "", nil, &chattemplate.InputError{Field: "messages", Reason: "media", Media: true, Message: i}
		}
		var s string
		_ = json.Unmarshal(m.Content, &s)
		text += s
	}
	ids, err := tokenize.Builtin{}.Encode(text, true)
	return text, ids, err
}
