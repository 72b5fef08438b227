package enginesim

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestResponsesAndMessagesSpeakVLLM: both APIs answer in vLLM's shapes with
// cached tokens in their usage; a stored response is continued by
// previous_response_id (its history in the prompt), retrieved, not
// cancelled (it is not a background one), and an unknown id is vLLM's 404.
func TestResponsesAndMessagesSpeakVLLM(t *testing.T) {
	ts := startServer(t, Config{})
	long := words("context", 80)
	type usage struct {
		InputTokens        int `json:"input_tokens"`
		InputTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
		CacheRead int `json:"cache_read_input_tokens"`
	}
	var first struct {
		ID, Object, Status string
		Output             []struct {
			Type    string
			Content []struct{ Type, Text string }
		}
		Usage usage
	}
	body := []byte(`{"model":"sim","instructions":"Be brief.","input":"` + long + `","max_output_tokens":3}`)
	for i := range 2 {
		code, out := ts.do(t, "POST", "/v1/responses", body)
		if err := json.Unmarshal(out, &first); code != 200 || err != nil {
			t.Fatalf("%d %v %s", code, err, out)
		}
		if cached := first.Usage.InputTokensDetails.CachedTokens; (i == 0) != (cached == 0) || cached >= first.Usage.InputTokens {
			t.Fatalf("turn %d: cached %d of %d", i, cached, first.Usage.InputTokens)
		}
	}
	if !strings.HasPrefix(first.ID, "resp_") || first.Object != "response" || first.Status != "completed" ||
		len(first.Output) != 1 || first.Output[0].Type != "message" || first.Output[0].Content[0].Type != "output_text" || first.Output[0].Content[0].Text == "" {
		t.Fatalf("response %+v", first)
	}
	// Instructions do not carry over (vLLM 01ca842d): a follow-up that
	// resends them continues the cached prefix; one that does not is
	// rendered without them.
	var next, bare struct {
		PreviousResponseID string `json:"previous_response_id"`
		Usage              usage
	}
	code, out := ts.do(t, "POST", "/v1/responses", []byte(`{"model":"sim","instructions":"Be brief.","input":"And then?","previous_response_id":"`+first.ID+`","max_output_tokens":2}`))
	if err := json.Unmarshal(out, &next); code != 200 || err != nil || next.PreviousResponseID != first.ID || next.Usage.InputTokens <= first.Usage.InputTokens ||
		next.Usage.InputTokensDetails.CachedTokens < first.Usage.InputTokensDetails.CachedTokens {
		t.Fatalf("follow-up: %d %s", code, out)
	}
	code, out = ts.do(t, "POST", "/v1/responses", []byte(`{"model":"sim","input":"And then?","previous_response_id":"`+first.ID+`","max_output_tokens":2}`))
	if err := json.Unmarshal(out, &bare); code != 200 || err != nil || bare.Usage.InputTokens >= next.Usage.InputTokens {
		t.Fatalf("follow-up without instructions: %d %s (with them: %d input tokens)", code, out, next.Usage.InputTokens)
	}
	if code, got := ts.do(t, "GET", "/v1/responses/"+first.ID, nil); code != 200 || !strings.Contains(string(got), `"id":"`+first.ID+`"`) {
		t.Errorf("retrieve: %d %s", code, got)
	}
	if code, got := ts.do(t, "POST", "/v1/responses/"+first.ID+"/cancel", nil); code != 400 || !strings.Contains(string(got), "Cannot cancel a synchronous response.") {
		t.Errorf("cancel: %d %s", code, got)
	}
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/v1/responses", `{"model":"sim","input":"x","previous_response_id":"resp_nope"}`},
		{"GET", "/v1/responses/resp_nope", ""},
	} {
		if code, got := ts.do(t, c.method, c.path, []byte(c.body)); code != 404 || !strings.Contains(string(got), `"message":"Response with id 'resp_nope' not found."`) {
			t.Errorf("%s %s: %d %s", c.method, c.path, code, got)
		}
	}
	code, out = ts.do(t, "POST", "/v1/responses", []byte(`{"model":"sim","input":"y","store":false}`))
	var unstored struct{ ID string }
	if err := json.Unmarshal(out, &unstored); code != 200 || err != nil {
		t.Fatalf("%d %s", code, out)
	}
	if code, _ := ts.do(t, "GET", "/v1/responses/"+unstored.ID, nil); code != 404 {
		t.Errorf("a response sent with store false was stored: GET %d", code)
	}

	msg := []byte(`{"model":"sim","system":"Be brief.","max_tokens":3,"stream":true,"messages":[{"role":"user","content":"` + long + `"}]}`)
	code, out = ts.do(t, "POST", "/v1/messages", msg)
	var types []string
	for _, ev := range strings.Split(strings.TrimSpace(string(out)), "\n\n") {
		typ, data, _ := strings.Cut(strings.TrimPrefix(ev, "event: "), "\ndata: ")
		if !strings.Contains(data, `"type":"`+typ+`"`) {
			t.Fatalf("event %q carries %s", typ, data)
		}
		if len(types) == 0 || types[len(types)-1] != typ {
			types = append(types, typ)
		}
		if typ == "message_delta" {
			var d struct{ Usage usage }
			if err := json.Unmarshal([]byte(data), &d); err != nil || d.Usage.CacheRead == 0 {
				t.Errorf("message_delta %s: want the prompt cached by the Responses turns", data)
			}
		}
	}
	if code != 200 || strings.Join(types, " ") != "message_start content_block_start content_block_delta content_block_stop message_delta message_stop" {
		t.Errorf("%d events %v", code, types)
	}
}
