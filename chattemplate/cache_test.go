package chattemplate

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ardanlabs/jinja"

	"github.com/kvmesh/kvmesh/admission"
)

func TestValueCacheHitAndEviction(t *testing.T) {
	c := newValueCache(2000, 0) // entries up to 500 bytes
	msg := func(i int) string {
		return fmt.Sprintf(`{"role":"user","content":"%s %d"}`, strings.Repeat("x", 400), i)
	}
	raw := []byte("[" + msg(1) + "," + msg(2) + "]")
	first, err := c.decodeArray(raw)
	if err != nil {
		t.Fatal(err)
	}
	if c.bytes != 2*len(msg(1)) || len(c.byKey) != 2 {
		t.Fatalf("after first decode: %d bytes, %d entries", c.bytes, len(c.byKey))
	}
	again, err := c.decodeArray(raw)
	if err != nil {
		t.Fatal(err)
	}
	// A hit returns the very same decoded dict, not a fresh decode.
	if first.AsList().Get(0).AsDict() != again.AsList().Get(0).AsDict() {
		t.Fatal("second decode of the same message was not served from the cache")
	}
	// Each message is ~435 bytes, so four fit in 2000; a fifth evicts the
	// least recently used one (message 1: message 2 was read after it).
	if _, err := c.decodeArray([]byte("[" + msg(3) + "," + msg(4) + "," + msg(5) + "]")); err != nil {
		t.Fatal(err)
	}
	if c.bytes > c.maxBytes {
		t.Fatalf("cache holds %d bytes, bound %d", c.bytes, c.maxBytes)
	}
	if len(c.byKey) != 4 {
		t.Fatalf("want 4 entries after eviction, got %d", len(c.byKey))
	}
	again, _ = c.decodeArray([]byte("[" + msg(1) + "]"))
	if again.AsList().Get(0).AsDict() == first.AsList().Get(0).AsDict() {
		t.Fatal("message 1 should have been evicted")
	}
}

func TestMayMutateInput(t *testing.T) {
	cases := map[string]bool{
		llama3Template: false,
		qwen25Template: false,
		`{% set ns = namespace(found=false) %}{% for m in messages %}{% set ns.found = true %}{% endfor %}`: false,
		`{% for m in messages %}{% set m.content = 'x' %}{% endfor %}`:                                      true,
		`{{ messages.append({'role': 'user'}) }}`:                                                           true,
		`{% do messages[0].update({'a': 1}) %}`:                                                             true,
		`{{ messages | reverse | list }}`:                                                                   false,
	}
	for src, want := range cases {
		pre, _, err := preprocess(src, false)
		if err != nil {
			t.Fatal(err)
		}
		if got := mayMutateInput(pre); got != want {
			t.Errorf("mayMutateInput(%q) = %v, want %v", src, got, want)
		}
	}
	tmpl, err := Compile(`{% for m in messages %}{% set m.content = 'x' %}{% endfor %}`)
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.values != nil {
		t.Error("a template that assigns to message attributes must not use the shared cache")
	}
}

// TestCachedRenderIsStable renders a growing conversation repeatedly and
// concurrently: cached and uncached renders must agree byte for byte.
func TestCachedRenderIsStable(t *testing.T) {
	tmpl, err := Compile(qwen25Template)
	if err != nil {
		t.Fatal(err)
	}
	cold := *tmpl
	cold.values = nil
	var msgs []string
	for i := range 12 {
		role := []string{"user", "assistant"}[i%2]
		msgs = append(msgs, fmt.Sprintf(`{"role":%q,"content":"turn %d %s"}`, role, i, strings.Repeat("long text ", 40)))
	}
	var wg sync.WaitGroup
	for n := 1; n <= len(msgs); n++ {
		in := Input{Messages: json.RawMessage("[" + strings.Join(msgs[:n], ",") + "]"), AddGenerationPrompt: true,
			Tools: json.RawMessage(`[{"type":"function","function":{"name":"f","description":"` + strings.Repeat("d", 300) + `"}}]`)}
		want, err := cold.Render(in)
		if err != nil {
			t.Fatal(err)
		}
		for range 4 {
			wg.Go(func() {
				for range 5 {
					if got, err := tmpl.Render(in); err != nil || got != want {
						t.Errorf("cached render differs (err %v)", err)
						return
					}
				}
			})
		}
	}
	wg.Wait()
}

// TestSharedCacheAdmitsOnSecondSighting: the process-wide cache keeps a
// message only once it has been seen before, so one-off prompts neither
// evict reusable entries nor add pointerful values for the GC to trace.
func TestSharedCacheAdmitsOnSecondSighting(t *testing.T) {
	c := newValueCache(1<<20, 0).withDoorkeeper(admission.New(1024))
	raw := []byte(`[{"role":"user","content":"` + strings.Repeat("y", 300) + `"}]`)
	decode := func() *jinja.Dict {
		v, err := c.decodeArray(raw)
		if err != nil {
			t.Fatal(err)
		}
		return v.AsList().Get(0).AsDict()
	}
	decode()
	if len(c.byKey) != 0 {
		t.Fatalf("first sighting cached %d entries", len(c.byKey))
	}
	second := decode()
	if len(c.byKey) != 1 {
		t.Fatalf("second sighting: %d entries, want 1", len(c.byKey))
	}
	if decode() != second {
		t.Fatal("third sighting was not served from the cache")
	}
}

// TestShortValuesHaveTheirOwnCache: values under the long cache's minimum
// go to the short cache (down to its own minimum), so a conversation's many
// short messages never evict its long ones.
func TestShortValuesHaveTheirOwnCache(t *testing.T) {
	short := newValueCache(1<<20, 32).withMaxEntries(2)
	c := newValueCache(1<<20, 256).withMaxEntries(1).withShort(short)
	long := fmt.Sprintf(`{"role":"system","content":%q}`, strings.Repeat("s", 300))
	raw := []byte(`[` + long + `,{"role":"user","content":"hi"},{"role":"user","content":"thanks"},{"role":"user","content":"more"},{"x":1}]`)
	first, err := c.decodeArray(raw)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.decodeArray(raw)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.byKey) != 1 || len(short.byKey) != 2 {
		t.Fatalf("long cache %d entries, short cache %d; want 1 and 2 (its bound)", len(c.byKey), len(short.byKey))
	}
	if first.AsList().Get(0).AsDict() != again.AsList().Get(0).AsDict() {
		t.Fatal("the long message was not kept beside the short ones")
	}
	if first.AsList().Get(3).AsDict() != again.AsList().Get(3).AsDict() {
		t.Fatal("the last short message was not served from the short cache")
	}
}
