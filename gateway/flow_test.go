package gateway

import (
	"encoding/json"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/quota"
	"github.com/kvmesh/kvmesh/tenant"
)

// flowRouter is a router with flow control over one real engine, replica
// "a", whose gossiped load the test sets: busy (a long engine queue, so
// the fleet is saturated) or idle.
type flowRouter struct {
	*testRouter
}

func newFlowRouter(t *testing.T, fc FlowControl, tenants *tenant.Directory) flowRouter {
	t.Helper()
	fc.Enabled = true
	r := newRouter(t, Settings{Flow: fc, Tenants: tenants}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
	fr := flowRouter{r}
	fr.busy(true)
	return fr
}

// busy sets replica a's engine queue: 200 waiting requests (seconds of
// predicted prefill) or none.
func (r flowRouter) busy(on bool) {
	l := fleet.Load{}
	if on {
		l.Waiting = 200
	}
	r.table.SetLoad("a", l, true, time.Now())
}

const flowChat = `{"model":"sim","max_tokens":2,"messages":[{"role":"user","content":"hello there"}]}`

// send posts flowChat in the background; the reply arrives on the channel.
func (r flowRouter) send(t *testing.T, headers ...string) <-chan reply {
	out := make(chan reply, 1)
	go func() { out <- r.post(t, "/v1/chat/completions", flowChat, headers...) }()
	return out
}

func waitReply(t *testing.T, c <-chan reply, within time.Duration) reply {
	t.Helper()
	select {
	case r := <-c:
		return r
	case <-time.After(within):
		t.Fatalf("no answer within %v", within)
		return reply{}
	}
}

// depth is the number of requests held, read as the dispatcher sees it.
func (r flowRouter) depth() int {
	r.g.flow.mu.Lock()
	defer r.g.flow.mu.Unlock()
	n := 0
	for _, q := range r.g.flow.pools {
		n += q.Len()
	}
	return n
}

func (r flowRouter) waitDepth(t *testing.T, n int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); r.depth() != n; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("held %d, want %d", r.depth(), n)
		}
	}
}

func TestHeldWhileSaturatedThenDispatched(t *testing.T) {
	r := newFlowRouter(t, FlowControl{}, nil)
	c := r.send(t)
	r.waitDepth(t, 1)
	time.Sleep(100 * time.Millisecond)
	select {
	case rep := <-c:
		t.Fatalf("answered while the fleet is saturated: %d %s", rep.status, rep.body)
	default:
	}
	if q := r.get(t, "/admin/queues"); q.status != 200 || !strings.Contains(q.body, `"queues":[{"model":"sim","held":1,"by_priority":{"standard":1},"by_tenant":{"default":1}}]`) {
		t.Fatalf("/admin/queues: %d %s", q.status, q.body)
	}
	r.busy(false)
	rep := waitReply(t, c, 5*time.Second)
	if rep.status != 200 || rep.header["x-kvmesh-replica"] != "a" {
		t.Fatalf("%d %v %s", rep.status, rep.header, rep.body)
	}
	if ms, _ := strconv.Atoi(rep.header["x-kvmesh-queue-ms"]); ms < 100 {
		t.Fatalf("X-Kvmesh-Queue-Ms %q, want the ≥ 100 ms it was held", rep.header["x-kvmesh-queue-ms"])
	}
	if rep.header["x-kvmesh-predicted-ttft-ms"] == "" {
		t.Fatal("no X-Kvmesh-Predicted-TTFT-Ms")
	}
	// Unsaturated: straight through, held 0 ms.
	if rep := r.post(t, "/v1/chat/completions", flowChat); rep.status != 200 || rep.header["x-kvmesh-queue-ms"] != "0" {
		t.Fatalf("idle fleet: %d queue %q", rep.status, rep.header["x-kvmesh-queue-ms"])
	}
	if inflight := r.g.Inflight(); inflight != 0 {
		t.Fatalf("%d requests still counted in flight", inflight)
	}
}

func TestHigherPriorityLeavesFirst(t *testing.T) {
	anyPriority, err := tenant.New(tenant.Spec{Default: tenant.Tenant{MaxPriority: flowcontrol.Critical}})
	if err != nil {
		t.Fatal(err)
	}
	r := newFlowRouter(t, FlowControl{MaxInflightPerReplica: 1}, anyPriority)
	engine, bodies := recordingEngine(t)
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: engine, Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, time.Now())
	var replies []<-chan reply
	for i, p := range []string{"sheddable", "standard", "critical"} {
		body := `{"model":"sim","max_tokens":2,"messages":[{"role":"user","content":"` + p + `"}]}`
		c := make(chan reply, 1)
		go func() { c <- r.post(t, "/v1/chat/completions", body, "X-Kvmesh-Priority", p) }()
		replies = append(replies, c)
		r.waitDepth(t, i+1)
	}
	// One request's room at a time: the engine queue is empty, and the
	// in-flight limit of 1 lets the next go as each ends.
	r.busy(false)
	for _, c := range replies {
		if rep := waitReply(t, c, 10*time.Second); rep.status != 200 {
			t.Fatalf("%d %s", rep.status, rep.body)
		}
	}
	var order []string
	for _, b := range bodies() {
		var body struct {
			Messages []struct{ Content string } `json:"messages"`
		}
		_ = json.Unmarshal([]byte(b), &body)
		order = append(order, body.Messages[0].Content)
	}
	if got := strings.Join(order, " "); got != "critical standard sheddable" {
		t.Fatalf("the engine got them in order %s", got)
	}
}

func TestWaitPastTheBoundIs503WithRetryAfter(t *testing.T) {
	fc := FlowControl{}
	fc.Bands[flowcontrol.Sheddable].MaxWait = 150 * time.Millisecond
	r := newFlowRouter(t, fc, nil)
	start := time.Now()
	rep := waitReply(t, r.send(t, "X-Kvmesh-Priority", "sheddable"), 5*time.Second)
	if rep.status != 503 || rep.header["retry-after"] == "" || rep.header["x-kvmesh-reject-reason"] != "saturated" ||
		!strings.Contains(rep.body, `"service_unavailable"`) {
		t.Fatalf("%d %v %s", rep.status, rep.header, rep.body)
	}
	if d := time.Since(start); d < 150*time.Millisecond || d > 2*time.Second {
		t.Fatalf("answered after %v, want its 150 ms bound", d)
	}
	if r.depth() != 0 {
		t.Fatal("still held")
	}
}

func TestTenantOverItsShareIs429(t *testing.T) {
	d, err := tenant.New(tenant.Spec{
		Default: tenant.Tenant{MaxPriority: flowcontrol.Standard},
		Tenants: []tenant.Tenant{{Name: "noisy", MaxPriority: flowcontrol.Standard}, {Name: "calm", MaxPriority: flowcontrol.Standard}},
		Keys:    [][]string{{"k-noisy"}, {"k-calm"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	fc := FlowControl{}
	fc.Bands[flowcontrol.Standard].MaxWait = time.Second
	r := newFlowRouter(t, fc, d)
	var noisy []<-chan reply
	for range 4 {
		noisy = append(noisy, r.send(t, "Authorization", "Bearer k-noisy"))
	}
	// Calm's bound comes last: each of noisy's is judged with calm held.
	r.waitDepth(t, 4)
	calm := r.send(t, "Authorization", "Bearer k-calm")
	r.waitDepth(t, 5)
	// Each of noisy's is judged on the queue as it stands when its bound
	// passes: over its share while it holds two or more beside calm's one;
	// its last, if judged alone with calm's, holds exactly its share.
	over := 0
	for _, c := range noisy {
		rep := waitReply(t, c, 5*time.Second)
		switch {
		case rep.status == 429 && rep.header["x-kvmesh-reject-reason"] == "over_share" &&
			strings.Contains(rep.body, "rate_limit_exceeded") && strings.Contains(rep.body, "tenant noisy"):
			over++
		case rep.status == 503 && rep.header["x-kvmesh-reject-reason"] == "saturated":
		default:
			t.Fatalf("noisy: %d %v %s", rep.status, rep.header, rep.body)
		}
	}
	if over < 3 {
		t.Fatalf("%d of noisy's 4 answered over_share, want at least 3", over)
	}
	if rep := waitReply(t, calm, 5*time.Second); rep.status != 503 || rep.header["x-kvmesh-reject-reason"] != "saturated" {
		t.Fatalf("calm, within its share: %d %v %s", rep.status, rep.header, rep.body)
	}
	if rep := r.post(t, "/v1/chat/completions", flowChat); rep.status != 401 {
		t.Fatalf("tenant keys configured, none sent: %d", rep.status)
	}
}

func TestClientLeavingFreesItsPlace(t *testing.T) {
	r := newFlowRouter(t, FlowControl{}, nil)
	req := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(len(flowChat)) + "\r\n\r\n" + flowChat
	conn, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write([]byte(req)); err != nil {
		t.Fatal(err)
	}
	r.waitDepth(t, 1)
	left := time.Now()
	_ = conn.Close()
	r.waitDepth(t, 0)
	if d := time.Since(left); d > time.Second {
		t.Fatalf("place freed %v after the client left", d)
	}
	if n := value(r.g.metrics.rejected.WithLabelValues("client_left")); n != 1 {
		t.Fatalf("client_left counted %v times", n)
	}
}

// TestPriorityIsBoundedByTheTenantsCeiling: the default tenant's ceiling is
// standard, so its "critical" waits behind standard requests held before.
func TestPriorityIsBoundedByTheTenantsCeiling(t *testing.T) {
	r := newFlowRouter(t, FlowControl{}, nil)
	std := r.send(t)
	r.waitDepth(t, 1)
	crit := r.send(t, "X-Kvmesh-Priority", "critical")
	r.waitDepth(t, 2)
	r.g.flow.mu.Lock()
	q := r.g.flow.pools[testModel]
	bands := [3]int{q.BandLen(flowcontrol.Critical), q.BandLen(flowcontrol.Standard), q.BandLen(flowcontrol.Sheddable)}
	r.g.flow.mu.Unlock()
	if bands != [3]int{0, 2, 0} {
		t.Fatalf("held by band %v, want both standard", bands)
	}
	r.busy(false)
	waitReply(t, std, 5*time.Second)
	waitReply(t, crit, 5*time.Second)
}

func TestSheddableMissingItsSLOIsTurnedAwayAtOnce(t *testing.T) {
	r := newFlowRouter(t, FlowControl{}, nil)
	rep := r.post(t, "/v1/chat/completions", flowChat, "X-Kvmesh-Priority", "sheddable", "X-Kvmesh-TTFT-SLO-Ms", "50")
	if rep.status != 503 || rep.header["x-kvmesh-reject-reason"] != "slo" {
		t.Fatalf("%d %v %s", rep.status, rep.header, rep.body)
	}
	for h, v := range map[string]string{"X-Kvmesh-Priority": "urgent", "X-Kvmesh-TTFT-SLO-Ms": "soon"} {
		if rep := r.post(t, "/v1/chat/completions", flowChat, h, v); rep.status != 400 || !strings.Contains(rep.body, h) {
			t.Fatalf("%s: %s: %d %s", h, v, rep.status, rep.body)
		}
	}
}

func TestQuotaIs429WithRetryAfter(t *testing.T) {
	d, err := tenant.New(tenant.Spec{
		Default: tenant.Tenant{MaxPriority: flowcontrol.Standard, Quota: quota.Limits{RequestsPerMinute: 2}},
	})
	if err != nil {
		t.Fatal(err)
	}
	r := newFlowRouter(t, FlowControl{}, d)
	r.busy(false)
	for i := range 3 {
		rep := r.post(t, "/v1/chat/completions", flowChat)
		want := 200
		if i == 2 {
			want = 429
		}
		if rep.status != want {
			t.Fatalf("request %d: %d %s", i, rep.status, rep.body)
		}
		if want == 429 && (rep.header["x-kvmesh-reject-reason"] != "quota" || rep.header["retry-after"] == "" || !strings.Contains(rep.body, "2 requests a minute")) {
			t.Fatalf("%v %s", rep.header, rep.body)
		}
	}
}

// recordingEngine answers every chat with a fixed completion and returns
// the bodies it received, in order.
func recordingEngine(t *testing.T) (string, func() []string) {
	var mu sync.Mutex
	var bodies []string
	url := listen(t, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		mu.Lock()
		bodies = append(bodies, string(ctx.PostBody()))
		mu.Unlock()
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}`)
	}})
	return url, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), bodies...)
	}
}

func TestEnginePriorityCarriesTheBand(t *testing.T) {
	anyPriority, err := tenant.New(tenant.Spec{Default: tenant.Tenant{MaxPriority: flowcontrol.Critical}})
	if err != nil {
		t.Fatal(err)
	}
	r := newRouter(t, Settings{Tenants: anyPriority, Models: map[string]Model{testModel: {EnginePriority: true}}}, 1<<20)
	engine, bodies := recordingEngine(t)
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: engine, Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, time.Now())
	r.table.SetLoad("a", fleet.Load{}, true, time.Now())
	for _, p := range []string{"critical", "", "sheddable"} {
		if rep := r.post(t, "/v1/chat/completions", flowChat, "X-Kvmesh-Priority", p); rep.status != 200 {
			t.Fatalf("%d %s", rep.status, rep.body)
		}
	}
	got := bodies()
	for i, want := range []string{`,"priority":-1}`, `,"priority":0}`, `,"priority":1}`} {
		if !strings.HasSuffix(got[i], want) {
			t.Errorf("request %d reached the engine as %s, want it to end %s", i, got[i], want)
		}
	}
}

// TestQuotaChargesWhatTheEngineCounted: a tenant's tokens are the engine's
// prompt and completion counts, not the max_tokens it asked for.
func TestQuotaChargesWhatTheEngineCounted(t *testing.T) {
	d, err := tenant.New(tenant.Spec{
		Default: tenant.Tenant{MaxPriority: flowcontrol.Standard, Quota: quota.Limits{TokensPerMinute: 100_000}},
	})
	if err != nil {
		t.Fatal(err)
	}
	url, _ := recordingEngine(t) // prompt 5, completion 1
	r := newRouter(t, Settings{Tenants: d}, 1<<20)
	r.table.AddStatic("a", url, []string{testModel})
	body := `{"model":"sim","max_tokens":500,"messages":[{"role":"user","content":"hello there"}]}`
	for range 2 {
		if rep := r.post(t, "/v1/chat/completions", body); rep.status != 200 {
			t.Fatalf("%d %s", rep.status, rep.body)
		}
	}
	if m := scrape(t, r, "kvmesh_router_tenant_tokens_total"); !strings.Contains(m, `tenant="default"} 12`) {
		t.Fatalf("charged %s; want 2 × (5 prompt + 1 completion)", m)
	}
}
