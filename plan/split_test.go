package plan

import (
	"fmt"
	"testing"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

// splitWant is a split plan as a case expects it: the prefill targets and
// the decode targets (with their modes and predicted cached tokens).
type splitWant struct {
	prefill []string
	targets []want
}

func gotSplit(p *Plan) splitWant {
	w := splitWant{targets: got(p)}
	for _, t := range p.Prefill {
		w.prefill = append(w.prefill, t.Name)
	}
	return w
}

// TestDecideSplit covers the planner on a disaggregated model: when a
// request is split (prefill pool by prefix, decode pool by load and KV
// room, the whole-request fallback last), and when it is served whole.
func TestDecideSplit(t *testing.T) {
	keys, promptTokens := keysOf(longPrompt, "")
	full := len(keys) * 16
	pool := func(mod func(r []replica)) []replica {
		r := []replica{
			{name: "p1", filter: true, role: fleet.KVPrefill}, {name: "p2", filter: true, role: fleet.KVPrefill},
			{name: "d1", filter: true, role: fleet.KVDecode}, {name: "d2", filter: true, role: fleet.KVDecode},
		}
		if mod != nil {
			mod(r)
		}
		return r
	}
	long := completion(t, longPrompt, "")
	cases := []struct {
		name  string
		reps  []replica
		req   *request.Request
		split Split
		min   int
		want  *splitWant // nil: check only
		check func(t *testing.T, p *Plan)
	}{
		{name: "a prefix on a prefill replica: prefilled there, decoded by load", req: long,
			reps: pool(func(r []replica) { r[1].holds = len(keys); r[2].others = 3 }),
			want: &splitWant{prefill: []string{"p2", "p1"}, targets: []want{
				{"d2", routing.ModeSplit, full, true, false}, {"d1", routing.ModeSplit, full, false, false}, {"d2", routing.ModeCold, 0, false, false}}},
			check: func(t *testing.T, p *Plan) {
				if pf := p.Prefill[0]; pf.Mode != routing.ModePrefix || pf.PredictedCached != full || pf.Uncached != promptTokens-full || pf.Teaches || !pf.Picked {
					t.Errorf("prefill target %+v", pf)
				}
				if d := p.Targets[0]; !d.Split || d.Uncached != 0 || p.Targets[2].Split {
					t.Errorf("decode targets %+v", p.Targets)
				}
			}},
		{name: "a prefix on a decode replica: served whole there", req: long,
			reps: pool(func(r []replica) { r[3].holds = len(keys) }),
			want: &splitWant{targets: []want{{"d2", routing.ModePrefix, full, true, true}, {"d1", routing.ModeBalance, 0, false, false}}}},
		{name: "a short prompt is served whole on a decode replica", req: completion(t, "hi there", ""), reps: pool(nil), min: 64,
			check: func(t *testing.T, p *Plan) {
				if len(p.Prefill) != 0 || len(p.Targets) != 2 || p.Targets[0].Split || p.Targets[0].Name[0] != 'd' || p.Targets[1].Name[0] != 'd' {
					t.Errorf("plan %+v", gotSplit(p))
				}
			}},
		{name: "always splits a short prompt", req: completion(t, "hi there", ""), reps: pool(nil), split: SplitAlways, min: 64,
			check: func(t *testing.T, p *Plan) {
				if len(p.Prefill) != 2 || !p.Targets[0].Split || p.Targets[0].Mode != routing.ModeSplit {
					t.Errorf("plan %+v", gotSplit(p))
				}
			}},
		{name: "never splits, and keeps to decode replicas", req: long, reps: pool(nil), split: SplitNever,
			check: func(t *testing.T, p *Plan) {
				if len(p.Prefill) != 0 || len(p.Targets) != 2 || p.Targets[0].Name[0] != 'd' || p.Targets[1].Name[0] != 'd' {
					t.Errorf("plan %+v", gotSplit(p))
				}
			}},
		{name: "a decode replica short of KV room comes last", req: long,
			reps: pool(func(r []replica) { r[2].others = 6; r[3].kvUsage = 0.97 }),
			check: func(t *testing.T, p *Plan) {
				if len(p.Targets) < 2 || p.Targets[0].Name != "d1" || p.Targets[1].Name != "d2" {
					t.Errorf("plan %+v", gotSplit(p))
				}
			}},
		{name: "no decode replica up: the prefill replicas serve it whole", req: long,
			reps: pool(func(r []replica) { r[2].offline, r[3].offline = true, true }),
			check: func(t *testing.T, p *Plan) {
				if len(p.Prefill) != 0 || len(p.Targets) != 2 || p.Targets[0].Name[0] != 'p' || p.Targets[0].Split {
					t.Errorf("plan %+v", gotSplit(p))
				}
			}},
		{name: "a both-role replica best for both sides: served whole there", req: long,
			reps: []replica{{name: "b", filter: true, holds: 2}, {name: "d1", filter: true, role: fleet.KVDecode}},
			check: func(t *testing.T, p *Plan) {
				if len(p.Prefill) != 0 || p.Targets[0].Name != "b" {
					t.Errorf("plan %+v", gotSplit(p))
				}
			}},
		{name: "a fleet of both-role replicas is not split", req: long, split: SplitAlways,
			reps: []replica{{name: "a", filter: true}, {name: "b", filter: true}},
			check: func(t *testing.T, p *Plan) {
				if len(p.Prefill) != 0 || p.Targets[0].Split {
					t.Errorf("plan %+v", gotSplit(p))
				}
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			snap := fleetOf(t, c.reps, keys)
			policy, err := routing.New("kvaware", routing.Config{})
			if err != nil {
				t.Fatal(err)
			}
			min := c.min
			if min == 0 {
				min = 32
			}
			in := Input{Snapshot: snap, Loads: make([]Load, len(snap.Replicas)), Request: c.req, Model: model,
				ModelSettings: Model{Tokenizer: tokenize.Builtin{}}, Now: t0,
				Settings: Settings{Policy: policy, MaxPrefixTokens: tokenize.DefaultMaxPrefixTokens, MaxPrefixBytes: tokenize.DefaultMaxPrefixBytes,
					MaxAttempts: 3, Split: c.split, SplitMinUncached: min}}
			var p Plan
			if err := p.Decide(&in); err != nil {
				t.Fatal(err)
			}
			if c.want != nil && fmt.Sprint(gotSplit(&p)) != fmt.Sprint(*c.want) {
				t.Errorf("plan\n got %+v\nwant %+v", gotSplit(&p), *c.want)
			}
			if c.check != nil {
				c.check(t, &p)
			}
			// The plan is reused: a decision on an aggregated fleet leaves no
			// prefill behind.
			in.Snapshot = fleetOf(t, []replica{{name: "a"}}, keys)
			in.Loads = make([]Load, 1)
			if err := p.Decide(&in); err != nil || len(p.Prefill) != 0 {
				t.Errorf("reused: %v, prefill %+v", err, p.Prefill)
			}
		})
	}
}
