package tokenize

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync/atomic"
	"testing"
	"time"
)

// fakeVLLM serves vLLM's /tokenize with the Builtin tokenizer.
type fakeVLLM struct {
	calls  atomic.Int32
	delay  time.Duration
	fail   atomic.Bool
	apiKey string // when set, required as a bearer token
}

func (f *fakeVLLM) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.calls.Add(1)
	if f.apiKey != "" && r.Header.Get("Authorization") != "Bearer "+f.apiKey {
		http.Error(w, `{"error":"Unauthorized"}`, http.StatusUnauthorized)
		return
	}
	if r.URL.Path != "/tokenize" || r.Method != http.MethodPost {
		http.NotFound(w, r)
		return
	}
	body, err := io.ReadAll(r.Body) // read first: the server notices a gone client only then
	if err != nil {
		return
	}
	if f.delay > 0 {
		select {
		case <-time.After(f.delay):
		case <-r.Context().Done():
			return
		}
	}
	if f.fail.Load() {
		http.Error(w, `{"error":{"message":"boom"}}`, http.StatusInternalServerError)
		return
	}
	var req struct {
		Model               string          `json:"model"`
		Prompt              *string         `json:"prompt"`
		Messages            json.RawMessage `json:"messages"`
		AddSpecialTokens    *bool           `json:"add_special_tokens"`
		AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	}
	if err := json.Unmarshal(body, &req); err != nil || req.Model != "m" {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	var ids []uint32
	switch {
	case req.Prompt != nil:
		add := req.AddSpecialTokens == nil || *req.AddSpecialTokens // vLLM default: true
		ids, err = Builtin{}.Encode(*req.Prompt, add)
	case req.Messages != nil:
		gen := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt // vLLM default: true
		_, ids, err = Builtin{}.EncodeChat(Chat{Messages: req.Messages, AddGenerationPrompt: gen})
	default:
		http.Error(w, "prompt or messages", http.StatusBadRequest)
		return
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": nil})
}

func TestEngineMatchesBuiltinAndCaches(t *testing.T) {
	f := &fakeVLLM{}
	srv := httptest.NewServer(f)
	defer srv.Close()
	e := NewEngine(srv.URL, "m")
	for _, add := range []bool{true, false} {
		got, err := e.Encode("Hello world, hi  there", add)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := Builtin{}.Encode("Hello world, hi  there", add)
		if !slices.Equal(got, want) {
			t.Fatalf("add=%v: got %v, want %v", add, got, want)
		}
	}
	chat := Chat{Messages: json.RawMessage(`[{"role":"user","content":"hi"}]`), AddGenerationPrompt: false}
	_, got, err := e.EncodeChat(chat)
	if err != nil {
		t.Fatal(err)
	}
	_, want, _ := Builtin{}.EncodeChat(chat)
	if !slices.Equal(got, want) {
		t.Fatalf("chat: got %v, want %v (add_generation_prompt=false must be sent)", got, want)
	}
	calls := f.calls.Load()
	got[0] = 999 // callers may scribble on results without touching the cache
	if _, again, err := e.EncodeChat(chat); err != nil || !slices.Equal(again, want) {
		t.Fatalf("cached chat: %v %v", again, err)
	}
	if _, err := e.Encode("Hello world, hi  there", true); err != nil {
		t.Fatal(err)
	}
	if f.calls.Load() != calls {
		t.Fatalf("cached requests reached the engine: %d calls, want %d", f.calls.Load(), calls)
	}
}

// TestEngineLeavesMediaToTheRouter: a chat holding an image is not sent to
// the engine (it would fetch the image); the answer names the message, as
// the template renderer's does, and the text before it is tokenized.
func TestEngineLeavesMediaToTheRouter(t *testing.T) {
	f := &fakeVLLM{}
	srv := httptest.NewServer(f)
	defer srv.Close()
	e := NewEngine(srv.URL, "m")
	msgs := `[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"What is this?"},{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}]}]`
	_, _, err := e.EncodeChat(Chat{Messages: json.RawMessage(msgs)})
	if k, media := MediaMessage(err); !media || k != 1 {
		t.Fatalf("got %v, want media in message 1", err)
	}
	if f.calls.Load() != 0 {
		t.Fatal("a chat with media reached the engine")
	}
	if _, ids, err := e.EncodeChat(Chat{Messages: json.RawMessage(`[{"role":"system","content":"Be brief."}]`)}); err != nil || len(ids) == 0 {
		t.Fatalf("the text before it: %v %v", ids, err)
	}
}

func TestEngineErrorsAreReturned(t *testing.T) {
	f := &fakeVLLM{delay: 2 * time.Second}
	srv := httptest.NewServer(f)
	defer srv.Close()
	e := NewEngine(srv.URL, "m", WithEngineTimeout(100*time.Millisecond))
	start := time.Now()
	if _, err := e.Encode("slow", true); err == nil {
		t.Fatal("timeout not reported")
	}
	if time.Since(start) > time.Second {
		t.Fatal("timeout not honoured")
	}

	f2 := &fakeVLLM{}
	f2.fail.Store(true)
	srv2 := httptest.NewServer(f2)
	defer srv2.Close()
	_, err := NewEngine(srv2.URL, "m").Encode("x", true)
	var ee *EngineError
	if !errors.As(err, &ee) || ee.Status != http.StatusInternalServerError {
		t.Fatalf("got %v, want an EngineError with HTTP 500", err)
	}
	f2.fail.Store(false) // failures are not cached
	if _, err := NewEngine(srv2.URL, "m").Encode("x", true); err != nil {
		t.Fatal(err)
	}
	if _, err := NewEngine("http://127.0.0.1:1", "m").Encode("x", true); err == nil {
		t.Fatal("connection refused not reported")
	}
	if _, err := NewEngine(srv2.URL, "other").Encode("x", true); err == nil {
		t.Fatal("HTTP 400 not reported")
	}
}

func TestEngineCacheBounded(t *testing.T) {
	c := newIDCache(2, 10)
	c.put(cacheKey{1}, []uint32{1, 2, 3})
	c.put(cacheKey{2}, []uint32{4, 5, 6})
	c.get(cacheKey{1}) // 1 is now the most recent
	c.put(cacheKey{3}, []uint32{7})
	if _, ok := c.get(cacheKey{2}); ok {
		t.Fatal("least recently used entry survived")
	}
	if _, ok := c.get(cacheKey{1}); !ok {
		t.Fatal("recent entry evicted")
	}
	c.put(cacheKey{4}, make([]uint32, 9)) // over the id budget with the others
	if c.ids > 10 || c.ll.Len() > 2 {
		t.Fatalf("cache holds %d ids in %d entries", c.ids, c.ll.Len())
	}
}

func FuzzDecodeTokenizeResponse(f *testing.F) {
	f.Add([]byte(`{"count":2,"max_model_len":10,"tokens":[1,2],"token_strs":null}`))
	f.Add([]byte(`{"count":3,"tokens":[1,2]}`))
	f.Add([]byte(`{"tokens":[-1]}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		ids, err := decodeTokenizeResponse(data)
		if err == nil && ids == nil {
			t.Fatal("nil ids without an error")
		}
	})
}

// TestEngineSendsAPIKey: an engine that wants a key (SGLang guards every
// path) gets it as a bearer token; without it the call fails.
func TestEngineSendsAPIKey(t *testing.T) {
	f := &fakeVLLM{apiKey: "engine-secret"}
	srv := httptest.NewServer(f)
	defer srv.Close()
	if _, err := NewEngine(srv.URL, "m", WithEngineAPIKey("engine-secret")).Encode("hello", true); err != nil {
		t.Fatalf("with the key: %v", err)
	}
	if _, err := NewEngine(srv.URL, "m").Encode("hello", true); err == nil {
		t.Fatal("without the key: no error")
	}
}
