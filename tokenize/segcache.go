package tokenize

import (
	"sync"

	"github.com/cespare/xxhash/v2"
)

// segmentCache keeps the ids of recently seen text between special tokens.
// HF tokenizes such segments independently of each other, so reusing their
// ids is exact; a multi-turn chat then only tokenizes its newest turn. It is
// an LRU bounded by bytes, sharded for concurrency; a hit does not allocate.
type segmentCache struct {
	shards [segmentShards]segmentShard
}

const segmentShards = 8

type segmentShard struct {
	mu         sync.Mutex
	m          map[uint64]*segmentEntry
	head       segmentEntry // sentinel of the recency ring: head.next is newest
	bytes, max int64
}

type segmentEntry struct {
	hash       uint64
	text       string
	first      bool
	ids        []uint32
	prev, next *segmentEntry
}

// entryOverhead approximates the bytes an entry costs beyond text and ids
// (entry, map slot, headers).
const entryOverhead = 128

func (e *segmentEntry) cost() int64 {
	return int64(len(e.text)+4*len(e.ids)) + entryOverhead
}

func newSegmentCache(maxBytes int64) *segmentCache {
	c := &segmentCache{}
	for i := range c.shards {
		sh := &c.shards[i]
		sh.m = make(map[uint64]*segmentEntry)
		sh.head.prev, sh.head.next = &sh.head, &sh.head
		sh.max = max(maxBytes/segmentShards, 1)
	}
	return c
}

func segmentHash(text string, first bool) uint64 {
	h := xxhash.Sum64String(text)
	if first {
		h ^= 0x9e3779b97f4a7c15
	}
	return h
}

// appendTo appends the cached ids of (text, first) to dst if present.
func (c *segmentCache) appendTo(dst []uint32, text string, first bool) ([]uint32, bool) {
	h := segmentHash(text, first)
	sh := &c.shards[h%segmentShards]
	sh.mu.Lock()
	e, ok := sh.m[h]
	if !ok || e.first != first || e.text != text {
		sh.mu.Unlock()
		return dst, false
	}
	sh.unlink(e)
	sh.pushFront(e)
	dst = append(dst, e.ids...)
	sh.mu.Unlock()
	return dst, true
}

func (c *segmentCache) put(text string, first bool, ids []uint32) {
	h := segmentHash(text, first)
	sh := &c.shards[h%segmentShards]
	e := &segmentEntry{hash: h, text: string([]byte(text)), first: first, ids: append([]uint32(nil), ids...)}
	if e.cost() > sh.max {
		return
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if old, ok := sh.m[h]; ok {
		sh.unlink(old)
		sh.bytes -= old.cost()
	}
	sh.m[h] = e
	sh.pushFront(e)
	sh.bytes += e.cost()
	for sh.bytes > sh.max {
		last := sh.head.prev
		sh.unlink(last)
		delete(sh.m, last.hash)
		sh.bytes -= last.cost()
	}
}

func (sh *segmentShard) unlink(e *segmentEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

func (sh *segmentShard) pushFront(e *segmentEntry) {
	e.prev, e.next = &sh.head, sh.head.next
	sh.head.next.prev = e
	sh.head.next = e
}
