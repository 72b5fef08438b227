package gateway

import (
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzParseRequest feeds arbitrary bodies to the request parser: it must
// answer a request error or a request, never panic, and when it adds
// include_usage the body must stay a JSON object asking for it.
func FuzzParseRequest(f *testing.F) {
	f.Add([]byte(chatBody), true)
	f.Add([]byte(`{"model":"m","prompt":[[1,2],[3]],"stream":true,"stream_options":{"continuous_usage_stats":true}}`), false)
	f.Add([]byte(`{"model":"m","prompt":["a","b"],"stream":true}`), false)
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"tools":[]}`), true)
	f.Add([]byte("{\"model\":\"\xff\"}"), true)
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		k := kindCompletion
		if chat {
			k = kindChat
		}
		p, err := parseRequest(body, k)
		if err != nil {
			if _, ok := err.(*requestError); !ok {
				t.Fatalf("error of type %T", err)
			}
			return
		}
		if !p.stream || p.wantsUsage {
			return
		}
		out, err := withIncludeUsage(body, p.StreamOptions)
		if err != nil {
			return
		}
		var got struct {
			StreamOptions struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		if err := json.Unmarshal(out, &got); err != nil || !got.StreamOptions.IncludeUsage {
			t.Fatalf("rewritten body %q: %v", out, err)
		}
	})
}

// FuzzEachElement checks the one-pass array walk against encoding/json on
// every valid array.
func FuzzEachElement(f *testing.F) {
	f.Add([]byte(`[{"a":"x,]\"}"}, "s", [1,[2]], 3 , null]`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		var want []json.RawMessage
		if json.Unmarshal(raw, &want) != nil || want == nil {
			return
		}
		var got [][]byte
		eachElement(bytes.TrimSpace(raw), func(e []byte) { got = append(got, bytes.TrimSpace(e)) })
		if len(got) != len(want) {
			t.Fatalf("%q: %d elements, want %d", raw, len(got), len(want))
		}
		for i := range got {
			if !bytes.Equal(got[i], bytes.TrimSpace(want[i])) {
				t.Fatalf("%q: element %d %q, want %q", raw, i, got[i], want[i])
			}
		}
	})
}
