package gateway

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
)

// TestRepeatPredictsWhatTheEngineCaches: a prompt whose every full block a
// replica's filter shows is predicted as cached exactly as the engine then
// reports it, on both sides of block boundaries: the engine recomputes the
// last prompt token, so a prompt ending on a boundary misses its last block.
func TestRepeatPredictsWhatTheEngineCaches(t *testing.T) {
	const bs = 16
	r := newRouter(t, Settings{}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: bs}, now)
	r.table.SetLoad("a", fleet.Load{}, true, now)
	lengths := []int{bs - 1, bs, bs + 1, 2 * bs, 3 * bs, 3*bs + 1}
	prompts := make([][]uint32, len(lengths))
	f := bloom.NewFilter(1024, 0.001)
	blocks := 0
	for i, n := range lengths {
		for j := range n {
			prompts[i] = append(prompts[i], uint32(1000*(i+1)+j))
		}
		for _, k := range blockkey.Append(nil, blockkey.Seed("", ""), prompts[i], bs) {
			f.Add(k)
			blocks++
		}
	}
	r.table.SetFilter("a", f, 1, blocks, now)
	for i, n := range lengths {
		ids := strings.Trim(strings.ReplaceAll(fmt.Sprint(prompts[i]), " ", ","), "[]")
		body := fmt.Sprintf(`{"model":"sim","prompt":[%s],"max_tokens":1}`, ids)
		r.post(t, "/v1/completions", body) // warms the engine
		res := r.post(t, "/v1/completions", body)
		var u struct {
			Usage struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if res.status != 200 || json.Unmarshal([]byte(res.body), &u) != nil {
			t.Fatalf("%d tokens: %d %s", n, res.status, res.body)
		}
		want := (n - 1) / bs * bs
		if u.Usage.Details.Cached != want {
			t.Errorf("%d tokens: engine cached %d, want %d", n, u.Usage.Details.Cached, want)
		}
		if got := res.header["x-kvmesh-cached-tokens"]; got != strconv.Itoa(u.Usage.Details.Cached) {
			t.Errorf("%d tokens: X-Kvmesh-Cached-Tokens %s, the engine cached %d", n, got, u.Usage.Details.Cached)
		}
	}
}
