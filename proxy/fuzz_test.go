package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"testing"
)

// FuzzWriteEvents checks the SSE splitter on arbitrary upstream bytes cut at
// an arbitrary point: without stripping, what is written plus the held-back
// tail is exactly the input, whatever the framing, also while a transcript
// follows the text (it drops events only in a continuation's lead).
func FuzzWriteEvents(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n"), 10)
	f.Add([]byte("data: x\r\n\r\n: ping\n\nevent: e\ndata: {\"usage\":1}\n\n"), 3)
	f.Add([]byte("data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n"), 40)
	f.Fuzz(func(t *testing.T, in []byte, cut int) {
		if cut < 0 || cut > len(in) {
			cut = len(in) / 2
		}
		relaysExactly(t, in, cut, &transcript{}, nil)
		// Stripping only ever removes whole events.
		var out bytes.Buffer
		w := bufio.NewWriter(&out)
		res := Result{PromptTokens: -1, CachedTokens: -1}
		done := false
		_, _ = writeEvents(w, in, true, &res, &done, &transcript{lead: true}, nil)
		_ = w.Flush()
		if out.Len() > len(in) {
			t.Fatalf("stripping grew the stream")
		}
	})
}

// FuzzUsageFromBody: any body is safe, and a body ending in a usage object
// yields exactly its numbers.
func FuzzUsageFromBody(f *testing.F) {
	f.Add([]byte(`{"choices":[{"text":"\"usage\":{"}]}`), uint16(12), uint16(7), uint16(3))
	f.Fuzz(func(t *testing.T, prefix []byte, prompt, cached, completion uint16) {
		usageFromBody(prefix)
		body := fmt.Sprintf(`{"x":%q,"usage":{"prompt_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}}`, prefix, prompt, completion, cached)
		if u := usageFromBody([]byte(body)); u != (Usage{Prompt: int(prompt), Cached: int(cached), Completion: int(completion)}) {
			t.Fatalf("%s: got %+v", body, u)
		}
	})
}

// relaysExactly relays in, cut at cut, as two reads would bring it, and
// checks that what is written plus the held-back tail is exactly in.
func relaysExactly(t *testing.T, in []byte, cut int, tr *transcript, dl *dialected) {
	t.Helper()
	var out bytes.Buffer
	w := bufio.NewWriter(&out)
	res := Result{PromptTokens: -1, CachedTokens: -1}
	done := false
	tail, err := writeEvents(w, in[:cut], false, &res, &done, tr, dl)
	if err != nil {
		t.Fatal(err)
	}
	tail, err = writeEvents(w, append(append([]byte(nil), tail...), in[cut:]...), false, &res, &done, tr, dl)
	if err != nil {
		t.Fatal(err)
	}
	_ = w.Flush()
	if got := append(out.Bytes(), tail...); !bytes.Equal(got, in) {
		t.Fatalf("relayed %q, want %q", got, in)
	}
}
