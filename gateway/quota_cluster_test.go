package gateway

import (
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/quota"
	"github.com/kvmesh/kvmesh/tenant"
)

// memCluster carries tenant-usage reports between gateways in process, as
// gossip does between routers.
type memCluster struct {
	mu    sync.Mutex
	peers map[string]*Gateway
}

type memMember struct {
	c    *memCluster
	name string
}

func (m memMember) ReportInflight(string, int, int) {}
func (m memMember) ClearRoutes([]string)            {}
func (m memMember) ShareTenantUsage(u []filterstream.TenantUsage) {
	m.c.mu.Lock()
	defer m.c.mu.Unlock()
	for name, g := range m.c.peers {
		if name != m.name {
			g.MergeTenantUsage(m.name, append([]filterstream.TenantUsage(nil), u...))
		}
	}
}

// TestQuotaHoldsAcrossRouters: two routers sharing a tenant's 20 requests a
// minute, sent three times that through both at once, admit no more than
// the quota allows (package quota's bound, here through the gateways).
func TestQuotaHoldsAcrossRouters(t *testing.T) {
	d, err := tenant.New(tenant.Spec{Default: tenant.Tenant{MaxPriority: flowcontrol.Standard, Quota: quota.Limits{RequestsPerMinute: 20}}})
	if err != nil {
		t.Fatal(err)
	}
	engine := startEngine(t, testModel)
	c := &memCluster{peers: map[string]*Gateway{}}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	var routers []*testRouter
	for _, name := range []string{"r1", "r2"} {
		r := newRouter(t, Settings{Tenants: d}, 1<<20)
		r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: engine, Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, time.Now())
		r.table.SetLoad("a", fleet.Load{}, true, time.Now())
		r.g.SetCluster(memMember{c, name})
		c.mu.Lock()
		c.peers[name] = r.g
		c.mu.Unlock()
		go r.g.ReportTenantUsage(50*time.Millisecond, stop)
		routers = append(routers, r)
	}
	time.Sleep(200 * time.Millisecond) // each has heard the other: the limit is shared
	admitted, refused := 0, 0
	for i := range 60 {
		rep := routers[i%2].post(t, "/v1/chat/completions", flowChat)
		switch rep.status {
		case 200:
			admitted++
		case 429:
			refused++
			if rep.header["x-kvmesh-reject-reason"] != "quota" {
				t.Fatalf("429 for %q", rep.header["x-kvmesh-reject-reason"])
			}
		default:
			t.Fatalf("%d %s", rep.status, rep.body)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("admitted %d of 60 against a quota of 20 a minute through 2 routers; %d refused", admitted, refused)
	if admitted > 22 || admitted < 15 {
		t.Fatalf("admitted %d, want the quota's 20 (±10 %%, and no router holding its share back for good)", admitted)
	}
}
