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

// An entry's key is the text's hash, length and first-ness; its value is the
// ids (little-endian) followed by the text itself, compared on every hit so
// that a hash collision can never return another segment's ids.
const segmentKeyLen = 17

func segmentKey(text string, first bool) [segmentKeyLen]byte {
	var k [segmentKeyLen]byte
	binary.LittleEndian.PutUint64(k[:], xxhash.Sum64String(text))
	binary.LittleEndian.PutUint64(k[8:], uint64(len(text)))
	if first {
		k[16] = 1
	}
	return k
}

// appendTo appends the cached ids of (text, first) to dst if present; buf
// is scratch the caller keeps (returned grown), so a hit does not allocate.
func (c *segmentCache) appendTo(dst []uint32, buf []byte, text string, first bool) ([]uint32, []byte, bool) {
	k := segmentKey(text, first)
	buf, _ = c.c.HasGet(buf[:0], k[:])
	if len(buf) == bigEntryMeta {
		buf = c.c.GetBig(buf[:0], k[:]) // stored by SetBig: this was its index
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
	k := segmentKey(text, first)
	if len(k)+len(buf)+4 < 64<<10 {
		c.c.Set(k[:], buf) // fits one fastcache chunk: one lookup per hit
	} else {
		c.c.SetBig(k[:], buf)
	}
	return buf
}

// bigEntryMeta is the length of the index SetBig stores under the key. No
// entry stored by Set has that length: segments are at least
// minCachedSegment (16) bytes and carry at least one id.
const bigEntryMeta = 16

func (c *segmentCache) reset() { c.c.Reset() }
