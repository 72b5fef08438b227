package gateway

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/storedid"
)

// TestStoredResponsesFollowedThroughTwoRouters: conversations that continue
// stored responses (previous_response_id) alternate between two routers
// over the same three replicas; every follow-up, streamed or not, reaches
// the replica that stored its predecessor (the engine would answer 404
// anywhere else), and so do retrievals and cancellations. Once that
// replica has left, the follow-up is the router's 404 naming it.
func TestStoredResponsesFollowedThroughTwoRouters(t *testing.T) {
	urls := []string{startEngine(t, testModel), startEngine(t, testModel), startEngine(t, testModel)}
	routers := []*testRouter{newRouter(t, Settings{}, 1<<20), newRouter(t, Settings{}, 1<<20)}
	now := time.Now()
	for _, r := range routers {
		for i, url := range urls {
			name := string(rune('a' + i))
			r.table.Upsert(fleet.Info{Name: name, Models: []string{testModel}, URL: url, Protocol: fleet.ProtocolVLLM}, now)
			r.table.SetLoad(name, fleet.Load{}, true, now)
		}
	}
	const conversations, turns = 6, 4
	followed := 0
	var last struct{ id, replica string }
	for c := range conversations {
		prev, home := "", ""
		for turn := range turns {
			r := routers[(c+turn)%2]
			stream := turn%2 == 1
			body := fmt.Sprintf(`{"model":"sim","input":"Conversation %d, turn %d: go on.","max_output_tokens":3,"stream":%v`, c, turn, stream)
			if prev != "" {
				body += fmt.Sprintf(`,"previous_response_id":%q`, prev)
			}
			res := r.post(t, "/v1/responses", body+"}")
			if res.status != 200 {
				t.Fatalf("conversation %d turn %d: %d %s", c, turn, res.status, res.body)
			}
			id := responseID(t, res.body, stream)
			replica, engineID, ok := storedid.Decode(id)
			if !ok || replica != res.header["x-kvmesh-replica"] || !strings.HasPrefix(engineID, "resp_") {
				t.Fatalf("conversation %d turn %d: id %q (replica %q) from %s", c, turn, id, replica, res.header["x-kvmesh-replica"])
			}
			if prev != "" {
				if replica != home {
					t.Fatalf("conversation %d turn %d: served by %s, its stored response is on %s", c, turn, replica, home)
				}
				if !strings.Contains(res.body, `"previous_response_id":"`+prev+`"`) {
					t.Errorf("conversation %d turn %d: the answer does not name its predecessor %s as the client knows it", c, turn, prev)
				}
				followed++
			}
			prev, home = id, replica
		}
		last.id, last.replica = prev, home
	}
	if followed != conversations*(turns-1) {
		t.Fatalf("%d follow-ups found their stored response, want %d", followed, conversations*(turns-1))
	}
	t.Logf("%d of %d follow-ups through 2 routers found their stored response", followed, conversations*(turns-1))
	for _, r := range routers {
		got := r.get(t, "/v1/responses/"+last.id)
		if got.status != 200 || got.header["x-kvmesh-replica"] != last.replica || responseID(t, got.body, false) != last.id {
			t.Errorf("GET the last response: %d %v %s", got.status, got.header, got.body)
		}
		// vLLM cancels background responses only: the engine's own 400.
		if got := r.post(t, "/v1/responses/"+last.id+"/cancel", ""); got.status != 400 || !strings.Contains(got.body, "Cannot cancel a synchronous response") {
			t.Errorf("cancel: %d %s", got.status, got.body)
		}
	}
	// The engine's 404 for an id it never stored comes through untouched.
	forged, _ := storedid.Encode(last.replica, "resp_0")
	if got := routers[0].get(t, "/v1/responses/"+forged); got.status != 404 || !strings.Contains(got.body, "Response with id 'resp_0' not found.") {
		t.Errorf("unknown id at its replica: %d %s", got.status, got.body)
	}
	routers[1].table.Remove(last.replica)
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/v1/responses", fmt.Sprintf(`{"model":"sim","input":"And then?","previous_response_id":%q}`, last.id)},
		{"GET", "/v1/responses/" + last.id, ""},
	} {
		var got reply
		if c.method == "POST" {
			got = routers[1].post(t, c.path, c.body)
		} else {
			got = routers[1].get(t, c.path)
		}
		var e struct {
			Error struct{ Message, Type string } `json:"error"`
		}
		_ = json.Unmarshal([]byte(got.body), &e)
		if got.status != 404 || e.Error.Type != "invalid_request_error" || !strings.Contains(e.Error.Message, fmt.Sprintf("stored by replica %q, which is no longer in the fleet", last.replica)) {
			t.Errorf("%s %s with its replica gone: %d %s", c.method, c.path, got.status, got.body)
		}
	}
	if m := routers[1].get(t, "/metrics").body; metricValue(m, `kvmesh_router_errors_total{type="stored_response_not_found"}`) != "2" {
		t.Errorf("the two 404s are not counted as stored_response_not_found")
	}
}

// responseID reads the id of a Responses answer: the body's, or for a
// stream that of its response.created event, which must be the id every
// event of the stream names.
func responseID(t *testing.T, body string, stream bool) string {
	t.Helper()
	if stream {
		created := responseID(t, lastEventData(t, body, "response.created", "response"), false)
		if done := responseID(t, lastEventData(t, body, "response.completed", "response"), false); done != created {
			t.Fatalf("the stream names %s, then %s", created, done)
		}
		return created
	}
	var v struct{ ID string }
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	return v.ID
}
