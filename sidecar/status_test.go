package sidecar

import (
	"encoding/json"
	"regexp"
	"testing"

	"github.com/kvmesh/kvmesh/gossip"
)

// TestStatusKeysAreSnakeCase: every key of /status, nested ones (the
// gossip counters under "cluster") included, is snake_case, and the keys
// the external contract names are there.
func TestStatusKeysAreSnakeCase(t *testing.T) {
	st := Status{ResetReasons: []string{"gap"}, Cluster: gossip.StatsSnapshot{
		Received: map[string]uint64{"load": 1, "clear_routes": 2}, Sent: map[string]uint64{"delta": 1},
		ReceivedBytesByKind: map[string]uint64{"snapshot": 3}, ResyncReasons: map[string]uint64{"block_size": 1},
	}}
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	snake := regexp.MustCompile(`^[a-z][a-z0-9]*(_[a-z0-9]+)*$`)
	var walk func(prefix string, v any) int
	walk = func(prefix string, v any) int {
		m, ok := v.(map[string]any)
		if !ok {
			return 0
		}
		n := 0
		for k, sub := range m {
			if !snake.MatchString(k) {
				t.Errorf("/status key %s%s is not snake_case", prefix, k)
			}
			n += 1 + walk(prefix+k+".", sub)
		}
		return n
	}
	if n := walk("", doc); n < 70 {
		t.Errorf("walked %d keys, want the whole document (≥ 70)", n)
	}
	for _, k := range []string{"name", "model", "block_size", "engine_healthy", "resident_blocks",
		"filter_generation", "events_received", "last_seq", "orphan_blocks"} {
		if _, ok := doc[k]; !ok {
			t.Errorf("/status lacks the contract's %q", k)
		}
	}
	cluster, _ := doc["cluster"].(map[string]any)
	if _, ok := cluster["sent_bytes"]; !ok {
		t.Errorf("cluster: %v, want sent_bytes", cluster)
	}
}
