package gateway

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
)

// TestSessionHeadersPlaceASessionAtItsHome: requests naming a session in
// any default session header (or a configured one) go to the session's one
// home, counted as placed home; without a header nothing is counted; with
// session headers configured away, the header is no hint.
func TestSessionHeadersPlaceASessionAtItsHome(t *testing.T) {
	for _, c := range []struct {
		name     string
		headers  []string
		header   string
		counted  bool
		settings Settings
	}{
		{name: "X-Session-Id", header: "X-Session-Id", counted: true},
		{name: "Claude Code", header: "x-claude-code-session-id", counted: true},
		{name: "Codex", header: "session_id", counted: true},
		{name: "configured", header: "X-My-Agent", counted: true, settings: Settings{SessionHeaders: []string{"X-My-Agent"}}},
		{name: "none configured", header: "X-Session-Id", settings: Settings{SessionHeaders: []string{}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRouter(t, c.settings, 1<<20)
			now := time.Now()
			for _, n := range []string{"a", "b", "c", "d"} {
				r.table.Upsert(fleet.Info{Name: n, Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
				r.table.SetLoad(n, fleet.Load{}, true, now)
				r.table.SetFilter(n, bloom.NewFilter(1024, 0.001), 1, 0, now)
			}
			homes := map[string]int{}
			for i := range 6 {
				body := fmt.Sprintf(`{"model":"sim","input":%q,"max_output_tokens":1,"store":false}`, fmt.Sprintf("Task %d: ", i)+strings.Repeat("refactor the parser again. ", 10))
				res := r.post(t, "/v1/responses", body, c.header, "session-42")
				if res.status != 200 {
					t.Fatalf("%d %s", res.status, res.body)
				}
				homes[res.header["x-kvmesh-replica"]]++
				r.g.ClearRecords(nil) // no record of an earlier task steers the next
			}
			m := r.get(t, "/metrics").body
			home, elsewhere := metricValue(m, `kvmesh_router_session_requests_total{placement="home"}`), metricValue(m, `kvmesh_router_session_requests_total{placement="elsewhere"}`)
			if c.counted && (len(homes) != 1 || home != "6" || elsewhere != "0") {
				t.Errorf("served at %v; home %s, elsewhere %s; want one replica, 6 at home", homes, home, elsewhere)
			}
			if !c.counted && (home != "0" || elsewhere != "0") {
				t.Errorf("counted a session nobody configured: home %s, elsewhere %s", home, elsewhere)
			}
		})
	}
}
