package tokenize

import (
	"encoding/binary"

	"github.com/VictoriaMetrics/fastcache"
	"github.com/cespare/xxhash/v2"
)

// segmentCache keeps the ids of recently seen text between special tokens.
// HF tokenizes such segments independently of each other, so reusing their
// ids is exact; a multi-turn chat then only tokenizes its newest turn.
//
// The entries live in fastcache's ring buffers, outside the Go heap: however
// full the cache is, the garbage collector has nothing in it to trace. (A
// pointer-linked LRU of the same size added ≈0.13 µs of mark work per entry
// to every GC cycle, some 10 ms when full, paid by requests in flight.) The
// price is eviction by insertion order rather than by use: a hot system
// prompt is tokenized again once per turn of the ring.
type segmentCache struct {
	c        *fastcache.Cache
	maxBytes int64
}

// minSegmentCacheBytes is fastcache's smallest size (one 64 KiB chunk for
// each of its 512 buckets); smaller bounds are raised to it.
const minSegmentCacheBytes = 32 << 20

func newSegmentCache(maxBytes int64) *segmentCache {
	maxBytes = max(maxBytes, minSegmentCacheBytes)
	return &segmentCache{c: fastcache.New(int(maxBytes)), maxBytes: maxBytes}
}

// An entry's key is the text's hash, length, first-ness and whether the
// entry is big (stored by SetBig under its own keys, so an index SetBig
// keeps is never mistaken for ids); its value is the ids (little-endian)
// followed by the text itself, compared on every hit so that a hash
// collision can never return another segment's ids.
const segmentKeyLen = 17

const (
	keyFirst = 1 << iota
	keyBig
)

func segmentKey(text string, first, big bool) [segmentKeyLen]byte {
	var k [segmentKeyLen]byte
	binary.LittleEndian.PutUint64(k[:], xxhash.Sum64String(text))
	binary.LittleEndian.PutUint64(k[8:], uint64(len(text)))
	if first {
		k[16] |= keyFirst
	}
	if big {
		k[16] |= keyBig
	}
	return k
}

// maxInlineEntry is the largest key plus value fastcache keeps in one chunk
// (Set); larger entries take SetBig.
const maxInlineEntry = 64<<10 - 4

// minBigText is the shortest text whose entry may be big: below it, with at
// most one id per byte of text (as byte-level BPE gives), the entry is
// inline, so a lookup of a shorter text never needs a second probe.
const minBigText = (maxInlineEntry - segmentKeyLen) / 5

// appendTo appends the cached ids of (text, first) to dst if present; buf
// is scratch the caller keeps (returned grown), so a hit does not allocate.
func (c *segmentCache) appendTo(dst []uint32, buf []byte, text string, first bool) ([]uint32, []byte, bool) {
	k := segmentKey(text, first, false)
	buf, found := c.c.HasGet(buf[:0], k[:])
	if !found && len(text) >= minBigText {
		k = segmentKey(text, first, true)
		buf = c.c.GetBig(buf[:0], k[:])
	}
	n := len(buf) - len(text)
	if n < 0 || n%4 != 0 || string(buf[n:]) != text {
		return dst, buf, false
	}
	for i := 0; i < n; i += 4 {
		dst = append(dst, binary.LittleEndian.Uint32(buf[i:]))
	}
	return dst, buf, true
}

// put stores the ids of (text, first), using buf as scratch.
func (c *segmentCache) put(buf []byte, text string, first bool, ids []uint32) []byte {
	if int64(4*len(ids)+len(text)) > c.maxBytes/64 {
		return buf // one entry must not flush a good part of the ring
	}
	buf = buf[:0]
	for _, id := range ids {
		buf = binary.LittleEndian.AppendUint32(buf, id)
	}
	buf = append(buf, text...)
	switch {
	case segmentKeyLen+len(buf) < maxInlineEntry:
		k := segmentKey(text, first, false)
		c.c.Set(k[:], buf) // one chunk: one lookup per hit
	case len(text) >= minBigText:
		k := segmentKey(text, first, true)
		c.c.SetBig(k[:], buf)
	}
	// Otherwise a short text with more ids than bytes: not worth a second
	// probe on every miss, so not cached.
	return buf
}

func (c *segmentCache) reset() { c.c.Reset() }
