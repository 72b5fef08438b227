package chattemplate

import (
	"bytes"
	"errors"
	"sync"

	"github.com/ardanlabs/jinja"
	"github.com/cespare/xxhash/v2"

	"github.com/kvmesh/kvmesh/admission"
)

// A growing multi-turn chat re-sends every earlier message on each request.
// Decoding those ~130 KB of JSON into template values was about a third of
// a 32k-token render, so decoded messages (and whole tools arrays) are kept
// in one process-wide LRU keyed by their exact JSON bytes. Decoded values do
// not depend on the template, so all templates share it.
//
// Sharing is safe because rendering never changes the values: transformers
// renders in jinja2's ImmutableSandboxedEnvironment, so templates that mutate
// their input (list.append, dict.update, ...) fail there; Compile marks such
// templates and they bypass the cache anyway.
//
// Cached values are pointerful jinja values, and every GC cycle marks them
// all: ≈0.33 µs per cached message (5 ms at 20,000, 33 ms at 100,000 on one
// core), which requests in flight pay as tail latency. The entry bound keeps
// that under ≈1.5 ms while holding some twenty 200-message conversations.
//
// Short values (under 256 bytes) live in a cache of their own: decoding and
// preparing even a 38-byte message costs ≈ 1.5 µs against ≈ 50 ns for a hit,
// and an agent's conversation is mostly short messages re-sent every turn,
// but in the same LRU they would crowd out the long messages that save the
// most (in a simulation of 90 conversations of 40 short and 10 long
// messages, long-message hits fell from 98 % to none).
const (
	valueCacheBytes   = 64 << 20 // bound on the cached JSON bytes
	valueCacheEntries = 4096     // bound on the entries: their GC cost
	minCachedElement  = 256      // shorter values go to the short cache

	shortCacheEntries = 8192 // short values are a few objects each
	minShortElement   = 32   // below, hardly a message: decoded each time
)

// sharedValues admits a value on its second sighting (package admission):
// the newest turn of a chat is decoded, not cached, until the next request
// of that chat shows it again. Cached values are pointerful, so one-offs
// kept here would lengthen every GC mark phase for nothing.
var sharedValues = newValueCache(valueCacheBytes, minCachedElement).withMaxEntries(valueCacheEntries).withDoorkeeper(admission.New(1 << 16)).
	withShort(newValueCache(shortCacheEntries*minCachedElement, minShortElement).withMaxEntries(shortCacheEntries).withDoorkeeper(admission.New(1 << 16)))

// prepFunc turns a decoded value into what the template is given (a
// message rebuilt as vLLM does, normalised tools). It must be a pure
// function of the value; index is the element's position, for errors.
type prepFunc func(v jinja.Value, index int) (jinja.Value, error)

type cacheEntry struct {
	key        uint64
	kind       byte   // which prepFunc produced val (0: none)
	raw        string // exact JSON bytes, compared on every hit
	val        jinja.Value
	prev, next *cacheEntry
}

type valueCache struct {
	mu         sync.Mutex
	maxBytes   int
	minElement int         // values shorter than this go to short, or are decoded
	short      *valueCache // nil: short values are decoded each time
	bytes      int
	byKey      map[uint64]*cacheEntry
	head       cacheEntry            // sentinel: head.next is the most recently used
	maxEntries int                   // 0: no bound but maxBytes
	door       *admission.Doorkeeper // nil: cache on first sight
}

func (c *valueCache) withMaxEntries(n int) *valueCache {
	c.maxEntries = n
	return c
}

func (c *valueCache) withDoorkeeper(d *admission.Doorkeeper) *valueCache {
	c.door = d
	return c
}

func (c *valueCache) withShort(short *valueCache) *valueCache {
	c.short = short
	return c
}

func newValueCache(maxBytes, minElement int) *valueCache {
	c := &valueCache{maxBytes: maxBytes, minElement: minElement, byKey: make(map[uint64]*cacheEntry)}
	c.head.next, c.head.prev = &c.head, &c.head
	return c
}

// decode returns the value of the JSON text raw (found at nesting depth),
// from the cache when the same bytes were decoded before.
func (c *valueCache) decode(raw []byte, depth int) (jinja.Value, error) {
	return c.decodePrep(raw, depth, 0, nil, 0)
}

// decodePrep decodes raw and passes the value through prep (identified by
// kind, 0 for none); the prepared value is what gets cached, so a hit costs
// neither the decode nor the preparation. Prep errors are not cached.
func (c *valueCache) decodePrep(raw []byte, depth int, kind byte, prep prepFunc, index int) (jinja.Value, error) {
	if len(raw) < c.minElement {
		if c.short != nil {
			return c.short.decodePrep(raw, depth, kind, prep, index)
		}
		return decodeAndPrep(string(raw), depth, prep, index)
	}
	key := xxhash.Sum64(raw) ^ uint64(kind)*0x9e3779b97f4a7c15
	c.mu.Lock()
	if e := c.byKey[key]; e != nil && e.kind == kind && e.raw == string(raw) {
		c.unlink(e)
		c.pushFront(e)
		c.mu.Unlock()
		return e.val, nil
	}
	c.mu.Unlock()

	// Decode outside the lock; strings in the value alias this copy, so
	// keeping it as the entry's key costs little extra memory.
	text := string(raw)
	v, err := decodeAndPrep(text, depth, prep, index)
	if err != nil || len(text) > c.maxBytes/4 || !c.door.Admit(key) {
		return v, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old := c.byKey[key]; old != nil {
		c.unlink(old)
		c.bytes -= len(old.raw)
	}
	e := &cacheEntry{key: key, kind: kind, raw: text, val: v}
	c.byKey[key] = e
	c.pushFront(e)
	c.bytes += len(text)
	for c.bytes > c.maxBytes || c.maxEntries > 0 && len(c.byKey) > c.maxEntries {
		last := c.head.prev
		c.unlink(last)
		delete(c.byKey, last.key)
		c.bytes -= len(last.raw)
	}
	return v, nil
}

// decodeAndPrep decodes text and applies prep. A decode error is a
// *jsonError so callers can tell it from a prep (validation) error.
func decodeAndPrep(text string, depth int, prep prepFunc, index int) (jinja.Value, error) {
	v, err := decodeJSONAt(text, depth)
	if err != nil {
		return v, &jsonError{err}
	}
	if prep == nil {
		return v, nil
	}
	return prep(v, index)
}

// jsonError marks a JSON syntax error (as opposed to a rejected value).
type jsonError struct{ err error }

func (e *jsonError) Error() string { return e.err.Error() }
func (e *jsonError) Unwrap() error { return e.err }

func (c *valueCache) unlink(e *cacheEntry) {
	e.prev.next = e.next
	e.next.prev = e.prev
}

func (c *valueCache) pushFront(e *cacheEntry) {
	e.prev = &c.head
	e.next = c.head.next
	c.head.next.prev = e
	c.head.next = e
}

// decodeArray decodes a JSON array element by element, each through the
// cache. It accepts exactly what decodeJSON accepts.
func (c *valueCache) decodeArray(raw []byte) (jinja.Value, error) {
	return c.decodeArrayPrep(raw, 0, nil)
}

// decodeArrayPrep is decodeArray with every element passed through prep
// (and cached prepared). If raw is valid JSON but not an array, the value
// is returned as decoded, without prep.
func (c *valueCache) decodeArrayPrep(raw []byte, kind byte, prep prepFunc) (jinja.Value, error) {
	whole := func() (jinja.Value, error) { return decodeWholeArray(raw, prep) }
	i := skipJSONSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return whole()
	}
	i = skipJSONSpace(raw, i+1)
	var items []jinja.Value
	if i < len(raw) && raw[i] == ']' {
		if skipJSONSpace(raw, i+1) != len(raw) {
			return whole()
		}
		return jinja.NewList(items), nil
	}
	for {
		end, ok := scanJSONValue(raw, i)
		if !ok {
			return whole() // reports the error with its offset
		}
		v, err := c.decodePrep(raw[i:end], 1, kind, prep, len(items))
		if err != nil {
			var je *jsonError
			if errors.As(err, &je) {
				return whole()
			}
			return jinja.Undefined(), err
		}
		items = append(items, v)
		i = skipJSONSpace(raw, end)
		if i >= len(raw) {
			return whole()
		}
		switch raw[i] {
		case ',':
			i = skipJSONSpace(raw, i+1)
		case ']':
			if skipJSONSpace(raw, i+1) != len(raw) {
				return whole()
			}
			return jinja.NewList(items), nil
		default:
			return whole()
		}
	}
}

// decodeWholeArray decodes raw in one piece (the uncached path, and the one
// that reports syntax errors with their offsets) and preps each element of
// an array.
func decodeWholeArray(raw []byte, prep prepFunc) (jinja.Value, error) {
	v, err := decodeJSON(string(raw))
	if err != nil {
		return v, &jsonError{err}
	}
	if prep == nil || !v.IsList() {
		return v, nil
	}
	items := make([]jinja.Value, v.AsList().Len())
	for i, item := range v.AsList().Items {
		if items[i], err = prep(item, i); err != nil {
			return jinja.Undefined(), err
		}
	}
	return jinja.NewList(items), nil
}

func skipJSONSpace(raw []byte, i int) int {
	for i < len(raw) && (raw[i] == ' ' || raw[i] == '\t' || raw[i] == '\n' || raw[i] == '\r') {
		i++
	}
	return i
}

// scanJSONValue finds the end of the JSON value starting at i without
// decoding it: strings are skipped escape-aware and brackets counted. It
// only delimits; the element's own decode validates it. ok is false when
// no end is found.
func scanJSONValue(raw []byte, i int) (end int, ok bool) {
	depth := 0
	for i < len(raw) {
		switch c := raw[i]; c {
		case '"':
			// Jump from quote to quote; one preceded by an odd run of
			// backslashes is escaped.
			i++
			for {
				j := bytes.IndexByte(raw[i:], '"')
				if j < 0 {
					return 0, false
				}
				j += i
				k := j
				for k > i && raw[k-1] == '\\' {
					k--
				}
				i = j + 1
				if (j-k)%2 == 0 {
					break
				}
			}
			if depth == 0 {
				return i, true
			}
		case '{', '[':
			depth++
			i++
		case '}', ']':
			if depth == 0 {
				return i, i > 0
			}
			depth--
			i++
			if depth == 0 {
				return i, true
			}
		case ',':
			if depth == 0 {
				return i, true
			}
			i++
		case ' ', '\t', '\n', '\r':
			if depth == 0 {
				return i, true
			}
			i++
		default:
			i++
		}
	}
	if depth == 0 {
		return i, true
	}
	return 0, false
}
