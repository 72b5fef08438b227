package gateway

import (
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/fleet"
)

// TestOrphanIsRoutedByLoadUntilItsEngineDies: a replica whose sidecar
// failed keeps taking requests by load while its engine answers; once the
// engine dies, the request that finds it dead is retried elsewhere and
// ejects it, and the router's health probe takes it offline.
func TestOrphanIsRoutedByLoadUntilItsEngineDies(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	now := time.Now()
	urlA, engineA := serveEngine(t, testModel, "")
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: urlA, KVEvents: true, BlockSize: 16}, now)
	r.table.SetLoad("a", fleet.Load{Waiting: 3}, true, now)
	r.table.Upsert(fleet.Info{Name: "b", Models: []string{testModel}, URL: startEngine(t, testModel), BlockSize: 16}, now)
	r.table.SetLoad("b", fleet.Load{Waiting: 20}, true, now)
	r.table.Orphan("a", now)

	for range 3 {
		res := r.post(t, "/v1/chat/completions", chatBody)
		// By load: cold placement or balance, never a prefix it is not known to hold.
		if res.status != 200 || res.header["x-kvmesh-replica"] != "a" || res.header["x-kvmesh-mode"] == "prefix" ||
			res.header["x-kvmesh-cached-tokens"] != "0" {
			t.Fatalf("orphan with a live engine: %d %v %s", res.status, res.header, res.body)
		}
	}
	r.g.probeOrphans(time.Second)
	if res := r.get(t, "/ready"); res.status != 200 || !strings.Contains(res.body, `"awaiting_filters":0,"ejected_replicas":0,"live_replicas":2`) {
		t.Fatalf("ready with the orphan live: %d %s", res.status, res.body)
	}
	if body := r.get(t, "/admin/replicas").body; !strings.Contains(body, `"name":"a"`) ||
		!strings.Contains(body, `"online":true,"selected":true,"kv_events":true,"stale":true,"orphan":true`) {
		t.Fatalf("admin view of the orphan: %s", body)
	}

	if err := engineA.Shutdown(); err != nil {
		t.Fatal(err)
	}
	res := r.post(t, "/v1/chat/completions", chatBody)
	if res.status != 200 || res.header["x-kvmesh-replica"] != "b" {
		t.Fatalf("orphan's engine dead: %d %v %s", res.status, res.header, res.body)
	}
	if m := r.get(t, "/metrics").body; !strings.Contains(m, `kvmesh_router_ejections_total{replica="a"} 1`) {
		t.Error("the dead orphan was not ejected")
	}
	r.g.probeOrphans(time.Second)
	if rep := r.table.Snapshot().Replicas[0]; rep.Name != "a" || rep.Online {
		t.Fatalf("dead orphan after a probe: %+v", rep)
	}
	if res := r.get(t, "/ready"); res.status != 200 || !strings.Contains(res.body, `"live_replicas":1,`) {
		t.Fatalf("ready with b live: %d %s", res.status, res.body)
	}
}
