package flowcontrol

import (
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)

func roomy() Config {
	var c Config
	for i := range c.Bands {
		c.Bands[i] = Limits{MaxQueued: 2000, MaxWait: time.Minute}
	}
	return c
}

type ticket = Ticket[int]

func push(t *testing.T, q *Queue[int], flow string, p Priority, cost int64, v int, now time.Time) *ticket {
	t.Helper()
	tk := &ticket{Flow: flow, Priority: p, Cost: cost, Value: v}
	if ev, err := q.Push(tk, now); err != nil || ev != nil {
		t.Fatalf("push %s/%d: evicted %v, %v", flow, v, ev, err)
	}
	return tk
}

// drain pops everything, returning "flow:value" in order.
func drain(q *Queue[int]) []string {
	var out []string
	for tk := q.Pop(); tk != nil; tk = q.Pop() {
		out = append(out, tk.Flow+":"+itoa(tk.Value))
	}
	return out
}

func itoa(v int) string { return strconv.Itoa(v) }

func TestBandsAreStrict(t *testing.T) {
	q := New[int](roomy())
	push(t, q, "a", Sheddable, 1, 1, t0)
	push(t, q, "a", Standard, 1, 2, t0)
	push(t, q, "b", Critical, 1000, 3, t0.Add(time.Second))
	push(t, q, "a", Standard, 1, 4, t0)
	got := strings.Join(drain(q), " ")
	if got != "b:3 a:2 a:4 a:1" {
		t.Fatalf("order %s", got)
	}
}

func TestFlowIsFirstComeFirstServed(t *testing.T) {
	q := New[int](roomy())
	for i := 1; i <= 5; i++ {
		push(t, q, "a", Standard, int64(100*i), i, t0.Add(time.Duration(i)))
	}
	if got := strings.Join(drain(q), " "); got != "a:1 a:2 a:3 a:4 a:5" {
		t.Fatalf("order %s", got)
	}
}

// A flow that queued a backlog first does not make a later one wait behind
// all of it: equal weights, equal costs alternate.
func TestBackloggedFlowsAlternate(t *testing.T) {
	q := New[int](roomy())
	for i := 0; i < 10; i++ {
		push(t, q, "noisy", Standard, 100, i, t0)
	}
	for i := 0; i < 3; i++ {
		push(t, q, "quiet", Standard, 100, i, t0.Add(time.Second))
	}
	got := strings.Join(drain(q)[:7], " ")
	if got != "noisy:0 quiet:0 noisy:1 quiet:1 noisy:2 quiet:2 noisy:3" {
		t.Fatalf("order %s", got)
	}
}

// Shares follow weights, and are counted in tokens, not requests.
func TestSharesFollowWeightsInTokens(t *testing.T) {
	cfg := roomy()
	cfg.Weight = func(f string) float64 {
		if f == "gold" {
			return 3
		}
		return 0 // not configured: weighs 1
	}
	q := New[int](cfg)
	for i := 0; i < 400; i++ {
		push(t, q, "gold", Standard, 100, i, t0)
		push(t, q, "plain", Standard, 100, i, t0)
		push(t, q, "big", Standard, 400, i, t0) // four times the tokens per request
	}
	tokens := map[string]int64{}
	for range 400 {
		tk := q.Pop()
		tokens[tk.Flow] += tk.Cost
	}
	// Over any window all three stay backlogged: gold 3/5 of the tokens,
	// plain and big 1/5 each (big in a quarter as many requests).
	total := float64(tokens["gold"] + tokens["plain"] + tokens["big"])
	for f, want := range map[string]float64{"gold": 0.6, "plain": 0.2, "big": 0.2} {
		if got := float64(tokens[f]) / total; got < want-0.02 || got > want+0.02 {
			t.Errorf("%s got %.3f of the tokens, want %.2f (%v)", f, got, want, tokens)
		}
	}
}

// A flow idle while another was served alone banks no credit: when it comes
// back it shares from then on, it does not take the band over.
func TestIdleFlowBanksNoCredit(t *testing.T) {
	q := New[int](roomy())
	for i := 0; i < 50; i++ {
		push(t, q, "busy", Standard, 100, i, t0)
	}
	for range 40 {
		q.Pop()
	}
	for i := 0; i < 10; i++ {
		push(t, q, "late", Standard, 100, i, t0.Add(time.Second))
	}
	got := drain(q)[:6]
	late := 0
	for _, s := range got {
		if strings.HasPrefix(s, "late") {
			late++
		}
	}
	if late != 3 {
		t.Fatalf("late got %d of the next 6 (%v), want 3", late, got)
	}
}

// A flow just served does not jump ahead by going idle and coming back.
func TestServedFlowKeepsItsPlace(t *testing.T) {
	q := New[int](roomy())
	push(t, q, "a", Standard, 1000, 1, t0)
	push(t, q, "b", Standard, 10, 1, t0)
	if tk := q.Pop(); tk.Flow != "a" {
		t.Fatalf("first %s", tk.Flow)
	}
	// a was served 1000 tokens; b holds 10. a's next waits for b's turn.
	push(t, q, "a", Standard, 10, 2, t0)
	push(t, q, "b", Standard, 10, 2, t0)
	if got := strings.Join(drain(q), " "); got != "b:1 b:2 a:2" {
		t.Fatalf("order %s", got)
	}
}

func TestBounds(t *testing.T) {
	cfg := Config{MaxQueued: 4}
	cfg.Bands[Critical] = Limits{MaxQueued: 4, MaxWait: time.Second}
	cfg.Bands[Standard] = Limits{MaxQueued: 3, MaxPerFlow: 2, MaxWait: time.Second}
	cfg.Bands[Sheddable] = Limits{MaxQueued: 2, MaxWait: time.Second}
	q := New[int](cfg)
	push(t, q, "a", Standard, 1, 1, t0)
	push(t, q, "a", Standard, 1, 2, t0)
	if _, err := q.Push(&ticket{Flow: "a", Priority: Standard}, t0); !errors.Is(err, ErrFlowFull) {
		t.Fatalf("third of a: %v", err)
	}
	push(t, q, "b", Standard, 1, 3, t0.Add(time.Millisecond))
	if _, err := q.Push(&ticket{Flow: "c", Priority: Standard}, t0); !errors.Is(err, ErrBandFull) {
		t.Fatalf("fourth standard: %v", err)
	}
	shed1 := push(t, q, "s", Sheddable, 1, 4, t0)
	// The queue is full (4): a sheddable cannot make room for another.
	if _, err := q.Push(&ticket{Flow: "s", Priority: Sheddable}, t0.Add(time.Millisecond)); !errors.Is(err, ErrBandFull) {
		t.Fatalf("sheddable into a full queue: %v", err)
	}
	// A critical one takes the sheddable's place.
	crit := &ticket{Flow: "x", Priority: Critical, Value: 9}
	ev, err := q.Push(crit, t0)
	if err != nil || ev != shed1 || ev.Reason != Evicted || ev.InQueue() {
		t.Fatalf("critical into a full queue: evicted %+v, %v", ev, err)
	}
	// Nothing lower is left to evict but standard: the newest standard goes.
	ev, err = q.Push(&ticket{Flow: "x", Priority: Critical}, t0)
	if err != nil || ev == nil || ev.Flow != "b" {
		t.Fatalf("second critical: evicted %+v, %v", ev, err)
	}
	if q.Len() != 4 || q.BandLen(Critical) != 2 || q.BandLen(Standard) != 2 || q.FlowLen(Standard, "a") != 2 {
		t.Fatalf("len %d, bands %d %d", q.Len(), q.BandLen(Critical), q.BandLen(Standard))
	}
}

func TestZeroLimitsHoldNothing(t *testing.T) {
	q := New[int](Config{})
	if _, err := q.Push(&ticket{Flow: "a"}, t0); !errors.Is(err, ErrBandFull) {
		t.Fatalf("push into a queue that holds nothing: %v", err)
	}
}

func TestExpireSaysWhoWasOverTheirShare(t *testing.T) {
	cfg := roomy()
	cfg.Bands[Standard].MaxWait = 10 * time.Second
	q := New[int](cfg)
	for i := 0; i < 9; i++ {
		push(t, q, "noisy", Standard, 100, i, t0)
	}
	quiet := push(t, q, "quiet", Standard, 100, 0, t0.Add(time.Second))
	if d := q.NextDeadline(); !d.Equal(t0.Add(10 * time.Second)) {
		t.Fatalf("next deadline %v", d)
	}
	if out := q.Expire(t0.Add(9*time.Second), nil); len(out) != 0 {
		t.Fatalf("expired early: %d", len(out))
	}
	out := q.Expire(t0.Add(10*time.Second), nil)
	if len(out) != 9 {
		t.Fatalf("expired %d at 10 s, want noisy's 9", len(out))
	}
	for _, tk := range out {
		if tk.Reason != OverShare || tk.InQueue() {
			t.Fatalf("noisy expired as %v", tk.Reason)
		}
	}
	out = q.Expire(t0.Add(11*time.Second), out[:0])
	if len(out) != 1 || out[0] != quiet || quiet.Reason != Saturated {
		t.Fatalf("quiet expired as %v (%d)", quiet.Reason, len(out))
	}
	if q.Len() != 0 || !q.NextDeadline().IsZero() || q.Pop() != nil {
		t.Fatal("queue not empty")
	}
}

func TestRemoveFreesThePlaceAtOnce(t *testing.T) {
	q := New[int](roomy())
	a1 := push(t, q, "a", Standard, 1, 1, t0)
	a2 := push(t, q, "a", Standard, 1, 2, t0)
	push(t, q, "b", Standard, 1, 1, t0)
	if !q.Remove(a1) || a1.Reason != Removed || q.Remove(a1) {
		t.Fatal("remove head")
	}
	if !q.Remove(a2) {
		t.Fatal("remove tail")
	}
	if got := strings.Join(drain(q), " "); got != "b:1" {
		t.Fatalf("left %s", got)
	}
	if n := len(q.bands[Standard].flows); n > 1 {
		t.Fatalf("%d flows remembered", n)
	}
}

func TestReconfigureKeepsWhatIsHeld(t *testing.T) {
	q := New[int](roomy())
	push(t, q, "a", Standard, 1, 1, t0)
	push(t, q, "a", Standard, 1, 2, t0)
	cfg := roomy()
	cfg.Bands[Standard].MaxQueued = 1
	q.Reconfigure(cfg)
	if _, err := q.Push(&ticket{Flow: "b", Priority: Standard}, t0); !errors.Is(err, ErrBandFull) {
		t.Fatalf("push past the new bound: %v", err)
	}
	if got := strings.Join(drain(q), " "); got != "a:1 a:2" {
		t.Fatalf("held %s", got)
	}
}

// Flows are forgotten once idle with nothing owed: memory follows what is
// held, not every tenant name ever seen.
func TestFlowsAreForgotten(t *testing.T) {
	q := New[int](roomy())
	for i := 0; i < 10000; i++ {
		push(t, q, "tenant-"+itoa(i), Standard, 100, i, t0)
		q.Pop()
	}
	if n := len(q.bands[Standard].flows); n > 40 {
		t.Fatalf("%d flows remembered with nothing queued", n)
	}
}

// Random operations keep the queue's books: counts, costs, the order of
// bands, and every ticket leaving exactly once.
func TestRandomOperationsKeepTheBooks(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	cfg := Config{MaxQueued: 60, Weight: func(f string) float64 { return float64(len(f)) }}
	for i := range cfg.Bands {
		cfg.Bands[i] = Limits{MaxQueued: 30, MaxPerFlow: 12, MaxWait: time.Duration(1+i) * time.Second}
	}
	q := New[int](cfg)
	held := map[*ticket]bool{}
	now := t0
	left := 0
	for step := 0; step < 20000; step++ {
		now = now.Add(time.Duration(rng.IntN(50)) * time.Millisecond)
		switch op := rng.IntN(10); {
		case op < 5:
			tk := &ticket{Flow: strings.Repeat("f", 1+rng.IntN(4)), Priority: Priority(rng.IntN(3)), Cost: int64(rng.IntN(500)), Value: step}
			ev, err := q.Push(tk, now)
			if err == nil {
				held[tk] = true
			}
			if ev != nil {
				if !held[ev] || ev.Priority <= tk.Priority || ev.Reason != Evicted {
					t.Fatalf("step %d: evicted %+v for %+v", step, ev, tk)
				}
				delete(held, ev)
				left++
			}
		case op < 8:
			want := q.Peek()
			tk := q.Pop()
			if tk != want {
				t.Fatalf("step %d: Pop differs from Peek", step)
			}
			if tk != nil {
				for other := range held {
					if other != tk && other.Priority < tk.Priority {
						t.Fatalf("step %d: popped %v while %v held", step, tk.Priority, other.Priority)
					}
				}
				if !held[tk] || tk.Reason != Served {
					t.Fatalf("step %d: popped a ticket not held", step)
				}
				delete(held, tk)
				left++
			}
		case op < 9:
			for tk := range held {
				if !q.Remove(tk) {
					t.Fatalf("step %d: held ticket not removable", step)
				}
				delete(held, tk)
				left++
				break
			}
		default:
			for _, tk := range q.Expire(now, nil) {
				if !held[tk] || tk.Deadline.After(now) || (tk.Reason != Saturated && tk.Reason != OverShare) {
					t.Fatalf("step %d: expired %+v", step, tk)
				}
				delete(held, tk)
				left++
			}
		}
		if q.Len() != len(held) {
			t.Fatalf("step %d: Len %d, held %d", step, q.Len(), len(held))
		}
		var n [bands]int
		var cost [bands]int64
		for tk := range held {
			n[tk.Priority]++
			cost[tk.Priority] += max(tk.Cost, 1)
		}
		for p := range q.bands {
			if b := &q.bands[p]; b.n != n[p] || b.cost != cost[p] {
				t.Fatalf("step %d band %d: n %d cost %d, want %d %d", step, p, b.n, b.cost, n[p], cost[p])
			}
		}
	}
	if left < 5000 {
		t.Fatalf("only %d tickets left the queue", left)
	}
}

// BenchmarkPushPop is one request's way through a queue holding 1,000
// others of 50 tenants.
func BenchmarkPushPop(b *testing.B) {
	q := New[int](roomy())
	names := make([]string, 50)
	for i := range names {
		names[i] = "tenant-" + itoa(i)
	}
	tickets := make([]ticket, 1000)
	for i := range tickets {
		tickets[i] = ticket{Flow: names[i%50], Priority: Priority(i % 3), Cost: int64(100 + i%700)}
		q.Push(&tickets[i], t0)
	}
	now := t0
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		tk := q.Pop()
		*tk = ticket{Flow: tk.Flow, Priority: tk.Priority, Cost: tk.Cost}
		if _, err := q.Push(tk, now); err != nil {
			b.Fatal(err)
		}
	}
}

// TestUnderShare: a flow holding less than its weighted share of its
// band's queued tokens is under its share; alone, or at or over it, not.
func TestUnderShare(t *testing.T) {
	q := New[int](roomy())
	now := time.Unix(0, 0)
	alone := push(t, q, "noisy", Standard, 3000, 1, now)
	if q.UnderShare(alone) {
		t.Fatal("a flow alone in its band is under its share")
	}
	for i := range 5 {
		push(t, q, "noisy", Standard, 3000, i+2, now)
	}
	chat := push(t, q, "chat", Standard, 100, 1, now)
	other := push(t, q, "batch", Sheddable, 100, 1, now)
	if !q.UnderShare(chat) || q.UnderShare(alone) || q.UnderShare(other) {
		t.Fatalf("chat %v, noisy %v, batch alone in its band %v", q.UnderShare(chat), q.UnderShare(alone), q.UnderShare(other))
	}
	q.Remove(chat)
	if q.UnderShare(chat) {
		t.Fatal("a ticket no longer held is under its share")
	}
}
