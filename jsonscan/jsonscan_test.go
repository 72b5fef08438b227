package jsonscan

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
)

func nested(n int, inner string) []byte {
	return []byte(strings.Repeat("[", n) + inner + strings.Repeat("]", n))
}

// TestDepthWithinMatchesEncodingJSON: MaxDepth is where encoding/json
// stops, and brackets inside strings do not count.
func TestDepthWithinMatchesEncodingJSON(t *testing.T) {
	for _, c := range []struct {
		body []byte
		want bool
	}{
		{nested(MaxDepth, ""), true},
		{nested(MaxDepth+1, ""), false},
		{nested(MaxDepth-1, `{"a":1}`), true},
		{nested(MaxDepth, `{"a":1}`), false},
		{nested(MaxDepth, `"[[[{{"`), true},
		{nested(MaxDepth, `"\"[[[\\"`), true},
		{[]byte(`{"a":"` + strings.Repeat("[", 3*MaxDepth) + `"}`), true},
		{nested(3_000_000, ""), false},
	} {
		if got := DepthWithin(c.body, MaxDepth); got != c.want {
			t.Errorf("%.40s… (%d bytes): %v, want %v", c.body, len(c.body), got, c.want)
		}
		if got := json.Valid(c.body); got != c.want {
			t.Errorf("%.40s… (%d bytes): encoding/json says %v, the test wants %v", c.body, len(c.body), got, c.want)
		}
	}
	// Closers with nothing open cannot make room for more openers.
	if DepthWithin([]byte(strings.Repeat("]", MaxDepth)+string(nested(MaxDepth+1, ""))), MaxDepth) {
		t.Error("unbalanced closers ran the count down")
	}
}

// depth is the deepest nesting of the valid JSON text b, by encoding/json.
func depth(t *testing.T, b []byte) int {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber() // a valid number out of float64's range is no error here
	cur, deepest := 0, 0
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			return deepest
		}
		if err != nil {
			t.Fatalf("%q: %v", b, err)
		}
		switch tok {
		case json.Delim('['), json.Delim('{'):
			cur++
			deepest = max(deepest, cur)
		case json.Delim(']'), json.Delim('}'):
			cur--
		}
	}
}

// FuzzDepthWithin: for any valid JSON value wrapped in n arrays, DepthWithin
// agrees with the depth encoding/json reads, on either side of the limit.
func FuzzDepthWithin(f *testing.F) {
	f.Add([]byte(`{"a":[1,"]]",{"b":"\\\"[{"}]}`), uint16(MaxDepth-3), uint16(MaxDepth))
	f.Add([]byte(`"[[["`), uint16(MaxDepth+1), uint16(MaxDepth))
	f.Add([]byte(`[]`), uint16(5), uint16(5))
	f.Fuzz(func(t *testing.T, inner []byte, n, limit uint16) {
		if !json.Valid(inner) {
			return
		}
		body := nested(int(n), string(inner))
		want := depth(t, inner)+int(n) <= int(limit)
		if got := DepthWithin(body, int(limit)); got != want {
			t.Fatalf("%q in %d arrays, limit %d: %v, want %v", inner, n, limit, got, want)
		}
	})
}

func TestValueEnd(t *testing.T) {
	b := []byte(`{"a":"x\"}","b":[1,{"c":"]"}],"d":-1.5e3 ,"e":null}`)
	for _, c := range []struct {
		at   int
		want string
	}{
		{0, string(b)},
		{5, `"x\"}"`},
		{16, `[1,{"c":"]"}]`},
		{34, `-1.5e3`},
		{46, `null`},
	} {
		if got := string(b[c.at:ValueEnd(b, c.at)]); got != c.want {
			t.Errorf("at %d: %s, want %s", c.at, got, c.want)
		}
	}
	if ValueEnd(b, len(b)) != len(b) || ValueEnd([]byte(`[1,2`), 0) != 4 {
		t.Error("past the end, or an unclosed array")
	}
}
