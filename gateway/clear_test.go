package gateway

import (
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
)

// TestClearAnswersWhatItDropped: a clear answers, per replica it reached,
// the filter keys this router held for it (what the console shows), and
// the filter is gone from /admin/replicas after it.
func TestClearAnswersWhatItDropped(t *testing.T) {
	r := newRouter(t, Settings{AdminOpen: true}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: "http://127.0.0.1:1", Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
	r.table.SetLoad("a", fleet.Load{}, true, now)
	f := bloom.NewFilter(1024, 0.001)
	for k := range uint64(40) {
		f.Add(k)
	}
	r.table.SetFilter("a", f, 3, 40, now)
	r.table.AddStatic("s", "http://127.0.0.1:1", []string{testModel})

	want := `{"cleared":"all","replicas":[{"name":"a","filter_keys":40,"kv_events":true},` +
		`{"name":"s","filter_keys":0,"kv_events":false}],"filter_keys":40}`
	if res := r.post(t, "/admin/routes/clear", `{}`); res.status != 200 || res.body != want {
		t.Fatalf("clear all: %d %s, want %s", res.status, res.body, want)
	}
	if res := r.get(t, "/admin/replicas"); !strings.Contains(res.body, `"name":"a"`) || !strings.Contains(res.body, `"filter_generation":0,"filter_keys":0`) {
		t.Errorf("after the clear: %s, want a's filter gone", res.body)
	}
	want = `{"cleared":["a"],"replicas":[{"name":"a","filter_keys":0,"kv_events":true}],"filter_keys":0}`
	if res := r.post(t, "/admin/routes/clear", `{"replicas":["a"]}`); res.status != 200 || res.body != want {
		t.Fatalf("clear again: %d %s, want %s", res.status, res.body, want)
	}
}
