package request

import (
	"bytes"
	"encoding/json"
	"mime/multipart"
	"strings"
	"testing"
	"unicode/utf8"
)

const chatBody = `{"model":"sim","messages":[{"role":"system","content":"You are a careful assistant."},{"role":"user","content":"Hello"}]}`

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
		k := Completion
		if chat {
			k = Chat
		}
		p, err := Parse(body, k)
		if err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error of type %T", err)
			}
			return
		}
		if !p.Stream || p.WantsUsage {
			return
		}
		out, err := WithIncludeUsage(body, p.StreamOptions)
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
		eachElement(bytes.TrimSpace(raw), func(e []byte) bool { got = append(got, bytes.TrimSpace(e)); return true })
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

// FuzzDecodeTop checks the one-pass top-level decoder against
// encoding/json on valid objects (keys matched case-sensitively, as vLLM
// does, so inputs that differ only there are left out).
func FuzzDecodeTop(f *testing.F) {
	f.Add([]byte(chatBody))
	f.Add([]byte(`{"model":"a\"b","stream":true,"stream":false,"cache_salt":"s","prompt":[1,2],"x":{"model":1}}`))
	f.Add([]byte(`{"model":null,"add_special_tokens":1}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		// Parse rejects invalid UTF-8 before decoding; encoding/json
		// would replace it instead.
		if !utf8.Valid(body) || !json.Valid(body) || bytes.Contains(body, []byte(`\u`)) || bytes.ContainsFunc(body, func(r rune) bool { return r >= 'A' && r <= 'Z' }) {
			return
		}
		var want fields
		wantErr := json.Unmarshal(body, &want)
		var got fields
		gotErr := decodeTop(body, &got)
		if (wantErr == nil) != (gotErr == nil) {
			if t := bytes.TrimSpace(body); len(t) > 0 && t[0] != '{' {
				return // not an object: Parse rejects it before
			}
			t.Fatalf("%s: encoding/json error %v, decodeTop error %v", body, wantErr, gotErr)
		}
		if wantErr != nil {
			return
		}
		w, _ := json.Marshal(want)
		g, _ := json.Marshal(got)
		if !bytes.Equal(w, g) {
			t.Fatalf("%s:\nencoding/json %s\ndecodeTop     %s", body, w, g)
		}
	})
}

// FuzzValidMatchesStdlib: Parse validates bodies with validJSON for
// speed; it must accept exactly what encoding/json accepts, however deep
// the body nests (depth wraps it in that many arrays: encoding/json stops
// at 10,000, segmentio's Valid alone does not).
func FuzzValidMatchesStdlib(f *testing.F) {
	for _, s := range []string{chatBody, `{}`, `{"a":[1,2,{"b":null}],"c":"\u00e9\n"}`, `{"a":1,}`, `{"a":01}`, `{"a":"\x01"}`,
		`{"a":1e999}`, `{"a":-}`, `[1,2]`, ` {"a":true} `, `{"a":tru}`, `{"a":"\ud800"}`, `{"a":"\q"}`, `{"a":1}{}`, "{\"a\":\"\xff\"}"} {
		f.Add([]byte(s), uint16(0))
	}
	f.Add([]byte(`{"a":"[[","b":[{}]}`), uint16(9998))
	f.Add([]byte(`{"a":[]}`), uint16(9999))
	f.Add([]byte(`]]`), uint16(10002))
	f.Fuzz(func(t *testing.T, body []byte, depth uint16) {
		body = append(append(bytes.Repeat([]byte("["), int(depth)), body...), bytes.Repeat([]byte("]"), int(depth))...)
		if got, want := validJSON(body), json.Valid(body); got != want {
			t.Fatalf("%.200q (%d bytes): validJSON %v, encoding/json %v", body, len(body), got, want)
		}
	})
}

// FuzzPassThroughFields: any body to a passed-through endpoint, JSON or
// multipart, gets a request error or its fields, never a panic; a
// well-formed multipart body yields its model field.
func FuzzPassThroughFields(f *testing.F) {
	f.Add([]byte(`{"model":"m","input":"x","stream":true}`), "", "m")
	f.Add([]byte("--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b--\r\n"), "b", "whisper")
	f.Fuzz(func(t *testing.T, body []byte, boundary, model string) {
		if _, err := ParsePassthrough(body, boundary); err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error of type %T", err)
			}
		}
		if strings.ContainsAny(model, "\r\n") || len(model) > 1024 {
			return
		}
		var form bytes.Buffer
		mw := multipart.NewWriter(&form)
		_ = mw.WriteField("model", model)
		_ = mw.Close()
		var p Request
		if err := p.formFields(form.Bytes(), mw.Boundary()); err != nil || p.Model != model {
			t.Fatalf("model %q: got %q, %v", model, p.Model, err)
		}
	})
}
