package tokenize

import (
	"bytes"
	"container/list"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/kvmesh/kvmesh/chattemplate"
)

// Engine is a Model that asks an engine replica's vLLM /tokenize endpoint:
// exact for any model the engine serves, at the cost of a round trip, so
// answers are cached (bounded LRU keyed by a hash of the request). Any
// failure is returned as an error; the router then routes that request by
// load only. EncodeChat returns an empty prompt: /tokenize does not echo the
// rendered text.
type Engine struct {
	url           string
	model         string
	authorization string
	client        *http.Client
	timeout       time.Duration
	cache         *idCache
}

// EngineOption configures an Engine.
type EngineOption func(*Engine)

// WithEngineTimeout bounds one /tokenize call (default 2 s).
func WithEngineTimeout(d time.Duration) EngineOption {
	return func(e *Engine) { e.timeout = d }
}

// WithEngineCache bounds the answer cache by entries and by total ids
// (defaults 4096 entries, 16M ids ≈ 64 MB). 0 entries disables it.
func WithEngineCache(entries int, ids int64) EngineOption {
	return func(e *Engine) {
		e.cache = nil
		if entries > 0 && ids > 0 {
			e.cache = newIDCache(entries, ids)
		}
	}
}

// WithEngineAPIKey sends key as a bearer token, for engines started with
// an API key.
func WithEngineAPIKey(key string) EngineOption {
	return func(e *Engine) {
		e.authorization = ""
		if key != "" {
			e.authorization = "Bearer " + key
		}
	}
}

// WithEngineHTTPClient replaces the HTTP client (transport, TLS, proxies).
func WithEngineHTTPClient(c *http.Client) EngineOption {
	return func(e *Engine) { e.client = c }
}

// NewEngine returns a Model backed by the /tokenize endpoint of the engine
// at baseURL (e.g. "http://10.0.0.5:8000") for the served model name.
func NewEngine(baseURL, model string, opts ...EngineOption) *Engine {
	e := &Engine{
		url:     strings.TrimRight(baseURL, "/") + "/tokenize",
		model:   model,
		client:  http.DefaultClient,
		timeout: 2 * time.Second,
		cache:   newIDCache(4096, 16<<20),
	}
	for _, o := range opts {
		o(e)
	}
	return e
}

// maxEngineResponse bounds what one /tokenize answer may weigh.
const maxEngineResponse = 64 << 20

// EngineError is a failed /tokenize call.
type EngineError struct {
	URL    string
	Status int // 0 when no HTTP answer arrived
	Err    error
}

func (e *EngineError) Error() string {
	if e.Status != 0 {
		return fmt.Sprintf("tokenize: engine %s: HTTP %d: %v", e.URL, e.Status, e.Err)
	}
	return fmt.Sprintf("tokenize: engine %s: %v", e.URL, e.Err)
}

func (e *EngineError) Unwrap() error { return e.Err }

// Encode implements Model.
func (e *Engine) Encode(text string, addSpecialTokens bool) ([]uint32, error) {
	body, err := json.Marshal(struct {
		Model            string `json:"model"`
		Prompt           string `json:"prompt"`
		AddSpecialTokens bool   `json:"add_special_tokens"`
	}{e.model, text, addSpecialTokens})
	if err != nil {
		return nil, err
	}
	return e.tokenize(body, nil)
}

// EncodeChat implements Model; the prompt it returns is empty.
func (e *Engine) EncodeChat(chat Chat) (string, []uint32, error) {
	if len(chat.Messages) == 0 {
		return "", nil, errors.New("tokenize: chat without messages")
	}
	body, err := json.Marshal(struct {
		Model                string          `json:"model"`
		Messages             json.RawMessage `json:"messages"`
		Tools                json.RawMessage `json:"tools,omitempty"`
		ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs,omitempty"`
		AddGenerationPrompt  bool            `json:"add_generation_prompt"`
		ContinueFinalMessage bool            `json:"continue_final_message"`
		AddSpecialTokens     bool            `json:"add_special_tokens"`
	}{e.model, chat.Messages, nullToNil(chat.Tools), nullToNil(chat.TemplateKwargs),
		chat.AddGenerationPrompt, chat.ContinueFinalMessage, chat.AddSpecialTokens})
	if err != nil {
		return "", nil, fmt.Errorf("tokenize: chat request: %w", err)
	}
	ids, err := e.tokenize(body, func() error {
		// The engine would fetch and process the media only to count
		// tokens whose blocks no router can match (they are keyed by the
		// media's hash): answer as the renderer does (MediaMessage), and
		// the router asks again for the text before it. A chat in the
		// cache was sent, so it holds none: only a miss needs the look.
		if k, ok := chattemplate.FirstMediaMessage(chat.Messages); ok {
			return &chattemplate.InputError{Field: "messages", Reason: "media content parts are not sent to the engine's /tokenize", Media: true, Message: k}
		}
		return nil
	})
	return "", ids, err
}

func nullToNil(raw json.RawMessage) json.RawMessage {
	if isNull(raw) {
		return nil
	}
	return raw
}

// tokenize answers body from the cache or the engine; sendable, when not
// nil, may refuse it before it is sent.
func (e *Engine) tokenize(body []byte, sendable func() error) ([]uint32, error) {
	key := requestKey(body)
	if e.cache != nil {
		if ids, ok := e.cache.get(key); ok {
			return ids, nil
		}
	}
	if sendable != nil {
		if err := sendable(); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url, bytes.NewReader(body))
	if err != nil {
		return nil, &EngineError{URL: e.url, Err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	if e.authorization != "" {
		req.Header.Set("Authorization", e.authorization)
	}
	resp, err := e.client.Do(req)
	if err != nil {
		return nil, &EngineError{URL: e.url, Err: err}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxEngineResponse+1))
	if err != nil {
		return nil, &EngineError{URL: e.url, Status: resp.StatusCode, Err: err}
	}
	if resp.StatusCode != http.StatusOK {
		msg := strings.TrimSpace(string(data[:min(len(data), 512)]))
		return nil, &EngineError{URL: e.url, Status: resp.StatusCode, Err: errors.New(msg)}
	}
	if len(data) > maxEngineResponse {
		return nil, &EngineError{URL: e.url, Status: resp.StatusCode, Err: errors.New("response too large")}
	}
	ids, err := decodeTokenizeResponse(data)
	if err != nil {
		return nil, &EngineError{URL: e.url, Status: resp.StatusCode, Err: err}
	}
	if e.cache != nil {
		e.cache.put(key, ids)
	}
	return slicesClone(ids), nil
}

// decodeTokenizeResponse reads vLLM's {"count", "max_model_len", "tokens"}.
func decodeTokenizeResponse(data []byte) ([]uint32, error) {
	var r struct {
		Count  *int      `json:"count"`
		Tokens *[]uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("bad /tokenize response: %w", err)
	}
	if r.Tokens == nil {
		return nil, errors.New("bad /tokenize response: no tokens")
	}
	if r.Count != nil && *r.Count != len(*r.Tokens) {
		return nil, fmt.Errorf("bad /tokenize response: count %d but %d tokens", *r.Count, len(*r.Tokens))
	}
	return *r.Tokens, nil
}

func slicesClone(ids []uint32) []uint32 { return append([]uint32(nil), ids...) }

// cacheKey is 128 bits of two independent hashes of a request body, so a
// collision would need both to collide.
type cacheKey [2]uint64

func requestKey(body []byte) cacheKey {
	f := fnv.New64a()
	_, _ = f.Write(body)
	return cacheKey{xxhash.Sum64(body), f.Sum64()}
}

// idCache is a small LRU of request → ids, bounded by entries and ids.
type idCache struct {
	mu         sync.Mutex
	ll         *list.List
	m          map[cacheKey]*list.Element
	maxEntries int
	maxIDs     int64
	ids        int64
}

type idEntry struct {
	key cacheKey
	ids []uint32
}

func newIDCache(entries int, ids int64) *idCache {
	return &idCache{ll: list.New(), m: make(map[cacheKey]*list.Element), maxEntries: entries, maxIDs: ids}
}

func (c *idCache) get(k cacheKey) ([]uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.m[k]
	if !ok {
		return nil, false
	}
	c.ll.MoveToFront(el)
	return slicesClone(el.Value.(*idEntry).ids), true
}

func (c *idCache) put(k cacheKey, ids []uint32) {
	if int64(len(ids)) > c.maxIDs {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.m[k]; ok {
		c.ids -= int64(len(el.Value.(*idEntry).ids))
		c.ll.Remove(el)
	}
	c.m[k] = c.ll.PushFront(&idEntry{k, ids})
	c.ids += int64(len(ids))
	for c.ll.Len() > c.maxEntries || c.ids > c.maxIDs {
		last := c.ll.Back()
		e := last.Value.(*idEntry)
		c.ll.Remove(last)
		delete(c.m, e.key)
		c.ids -= int64(len(e.ids))
	}
}
