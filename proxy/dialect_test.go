package proxy

import (
	"bufio"
	"bytes"
	"strings"
	"testing"
)

// tagDialect is a test dialect: usage is "u:P:C", output any event but
// "created", and it rewrites "old" to "new-<target>".
type tagDialect struct{}

func (tagDialect) BodyUsage(body []byte) Usage { return noUsage }
func (tagDialect) EventUsage(p []byte) (Usage, bool) {
	if bytes.HasPrefix(p, []byte("u:")) {
		return Usage{Prompt: int(p[2] - '0'), Cached: int(p[4] - '0')}, true
	}
	return noUsage, false
}
func (tagDialect) StreamError(msg string) []byte {
	return []byte("event: error\ndata: " + msg + "\n\n")
}
func (tagDialect) Output(p []byte) bool { return !bytes.Equal(p, []byte("created")) }
func (tagDialect) Rewrite(i int, b []byte) []byte {
	if !bytes.Contains(b, []byte("old")) {
		return nil
	}
	return bytes.ReplaceAll(b, []byte("old"), []byte("new-"+string(rune('0'+i))))
}

// TestDialectEvents: a dialect's events ("event:" then "data:" lines) are
// relayed with their data rewritten, usage read from them, and the first
// token told at the first output event, not before.
func TestDialectEvents(t *testing.T) {
	in := "event: a\ndata: created\n\nevent: b\ndata: old text\n\n: ping\n\nevent: c\r\ndata:u:7:3\r\n\r\n"
	want := "event: a\ndata: created\n\nevent: b\ndata: new-2 text\n\n: ping\n\nevent: c\r\ndata:u:7:3\r\n\r\n"
	var out bytes.Buffer
	w := bufio.NewWriter(&out)
	firsts := 0
	var seenAt []string
	dl := &dialected{d: tagDialect{}, target: 2, first: func() { firsts++; seenAt = append(seenAt, out.String()) }}
	res := Result{PromptTokens: -1, CachedTokens: -1}
	done := false
	tail, err := writeEvents(w, []byte(in), false, &res, &done, nil, dl)
	_ = w.Flush()
	if err != nil || len(tail) != 0 || out.String() != want {
		t.Fatalf("relayed %q (tail %q, %v), want %q", out.String(), tail, err, want)
	}
	if res.PromptTokens != 7 || res.CachedTokens != 3 || res.Events != 4 || firsts != 1 {
		t.Errorf("usage %d/%d, %d events, first token told %d times", res.PromptTokens, res.CachedTokens, res.Events, firsts)
	}
	if len(seenAt) == 1 && strings.Contains(seenAt[0], "text") {
		t.Errorf("the first token was told after its event was written: %q", seenAt[0])
	}
}

// FuzzDialectEvents: with a dialect that rewrites nothing, any upstream
// bytes cut anywhere are relayed exactly, as without one.
func FuzzDialectEvents(f *testing.F) {
	f.Add([]byte("event: response.created\ndata: {\"type\":\"response.created\"}\n\nevent: x\ndata: u:1:1\n\n"), 20)
	f.Add([]byte("data:\n\nevent:\r\ndata\r\n\r\n"), 3)
	f.Fuzz(func(t *testing.T, in []byte, cut int) {
		if cut < 0 || cut > len(in) {
			cut = len(in) / 2
		}
		relaysExactly(t, in, cut, nil, &dialected{d: noRewrite{}, first: func() {}})
	})
}

type noRewrite struct{ tagDialect }

func (noRewrite) EventUsage([]byte) (Usage, bool) { return noUsage, false }
func (noRewrite) Rewrite(int, []byte) []byte      { return nil }
