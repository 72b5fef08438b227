package proxy

import (
	"testing"
	"time"
)

// TestUpstreamSame: a pool is kept only while its URL, API key and options
// are what the configuration asks for.
func TestUpstreamSame(t *testing.T) {
	opt := Options{FirstByteTimeout: time.Minute}
	u, err := NewUpstream("e1", "http://127.0.0.1:8000", "k1", opt)
	if err != nil {
		t.Fatal(err)
	}
	if !u.Same("http://127.0.0.1:8000", "k1", opt) {
		t.Error("identical settings not the same")
	}
	for name, same := range map[string]bool{
		"url":     u.Same("http://127.0.0.1:8001", "k1", opt),
		"key":     u.Same("http://127.0.0.1:8000", "k2", opt),
		"no key":  u.Same("http://127.0.0.1:8000", "", opt),
		"options": u.Same("http://127.0.0.1:8000", "k1", Options{FirstByteTimeout: 2 * time.Minute}),
	} {
		if same {
			t.Errorf("another %s counted as the same", name)
		}
	}
}
