package tokenize

import (
	"math/bits"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
)

// bpeModel is HF's BPE model: a piece is split into characters (or bytes,
// for byte-level vocabularies), then merged pair by pair, lowest merge rank
// first and leftmost among equals, exactly as tokenizers' Word::merge_all.
type bpeModel struct {
	// vocab maps a token to its id while the model loads; tokens then
	// freezes it (and vocab is dropped). For byte-level vocabularies the
	// keys are the raw bytes the token stands for (the GPT-2 byte-to-char
	// map undone), so pieces never need remapping.
	vocab  map[string]uint32
	tokens *vocabTable
	// short holds the vocab entries of at most 7 bytes packed into integer
	// keys (shortKey): most pieces are that short, and an integer probe is
	// a cache miss cheaper than a string map lookup.
	short *mergeTable
	// merges maps a pair of ids (a<<32|b) to rank<<32|merged id.
	merges    *mergeTable
	byteLevel bool
	// byteIDs holds the id of each single byte (byte-level only), -1 if
	// the vocabulary lacks it.
	byteIDs      [256]int32
	byteFallback bool
	fallbackIDs  [256]int32 // ids of <0xNN>, -1 if absent
	ignoreMerges bool
	unk          int32 // -1: no unk token
	fuseUnk      bool
	prefix       string // continuing_subword_prefix
	suffix       string // end_of_word_suffix
	cache        *pieceCache
	// splitMeta: no token holds "▁" after another character, so no merge
	// can join across the start of a "▁" run and a piece may be cut there
	// with the same result. SentencePiece-style models feed BPE whole
	// segments as one piece; cut into words they use the piece caches and
	// a small heap.
	splitMeta bool
}

const metaspace = "▁"

// checkSplitMeta decides splitMeta from the vocabulary (call when final).
func (m *bpeModel) checkSplitMeta() {
	if m.byteLevel || m.prefix != "" || m.suffix != "" {
		return
	}
	if _, ok := m.vocab[metaspace]; !ok {
		return
	}
	for tok := range m.vocab {
		for i := 1; i < len(tok); {
			k := strings.Index(tok[i:], metaspace)
			if k < 0 {
				break
			}
			j := i + k
			if !strings.HasSuffix(tok[:j], metaspace) {
				return
			}
			i = j + len(metaspace)
		}
	}
	m.splitMeta = true
}

// appendPieces appends the ids of a piece, cut before each "▁" run when
// splitMeta allows.
func (m *bpeModel) appendPieces(dst []uint32, piece string, sc *bpeScratch) []uint32 {
	if !m.splitMeta {
		return m.appendPiece(dst, piece, sc)
	}
	start := 0
	for i := 1; i < len(piece); {
		k := strings.Index(piece[i:], metaspace)
		if k < 0 {
			break
		}
		j := i + k
		if !strings.HasSuffix(piece[:j], metaspace) {
			dst = m.appendPiece(dst, piece[start:j], sc)
			start = j
		}
		i = j + len(metaspace)
	}
	return m.appendPiece(dst, piece[start:], sc)
}

// selfMerging flags a vocab value whose token, run through BPE on its own,
// comes out as that single token: a piece equal to it needs no merging.
const selfMerging = 1 << 31

// markSelfMerging runs BPE over every vocabulary token once (at load) and
// flags the tokens that merge into themselves.
func (m *bpeModel) markSelfMerging() {
	var sc bpeScratch
	for tok, v := range m.vocab {
		m.initial(tok, &sc)
		m.mergeAll(&sc)
		n, id := 0, uint32(0)
		for _, s := range sc.syms {
			if !s.removed {
				n++
				id = s.id
			}
		}
		if n == 1 && id == v {
			m.vocab[tok] = v | selfMerging
		}
	}
}

type symbol struct {
	id         uint32
	prev, next int32
	removed    bool
}

type mergeEntry struct {
	key         uint64 // rank<<32 | position: pops lowest rank, then leftmost
	newID       uint32
	left, right uint32 // the pair when queued
}

// bpeScratch is per-call working memory, pooled to keep encoding free of
// allocations on the hot path.
type bpeScratch struct {
	syms []symbol
	heap []mergeEntry
	hot  *hotCache
}

// hotCache is a small direct-mapped cache of recent pieces and their ids,
// owned by one pooled encoder (so no locks). Prose reuses a few thousand
// pieces; finding them here avoids the large vocabulary map and its cache
// misses. Keys are copied inline, so no caller text is kept alive.
type hotCache [hotEntries]hotEntry

const (
	hotEntries = 4096
	hotKeyLen  = 20
	hotIDs     = 3
)

type hotEntry struct {
	key [hotKeyLen]byte
	n   uint8 // key length; 0: empty
	cnt uint8
	ids [hotIDs]uint32
}

func pairKey(a, b uint32) uint64 { return uint64(a)<<32 | uint64(b) }

// mergeTable is an open-addressing hash table from pair keys to merges:
// one probe usually lands on the key and its value in one cache line,
// where a Go map costs two or three misses on a vocabulary this size.
type mergeTable struct {
	slots []mergeSlot
	shift uint
	n     int
}

type mergeSlot struct{ key, val uint64 }

// emptyKey cannot be a pair: ids stay below 2^31.
const emptyKey = ^uint64(0)

func newMergeTable(n int) *mergeTable {
	size := 16
	for size < n+n/3 {
		size *= 2
	}
	t := &mergeTable{slots: make([]mergeSlot, size), shift: uint(64 - bits.TrailingZeros(uint(size)))}
	for i := range t.slots {
		t.slots[i].key = emptyKey
	}
	return t
}

func (t *mergeTable) home(key uint64) uint64 { return (key * 0x9E3779B97F4A7C15) >> t.shift }

// set inserts or replaces (a later duplicate merge wins, as in HF),
// growing the table to keep it at most three quarters full.
func (t *mergeTable) set(key, val uint64) {
	if 4*(t.n+1) > 3*len(t.slots) {
		bigger := newMergeTable(2 * len(t.slots))
		for _, s := range t.slots {
			if s.key != emptyKey {
				bigger.set(s.key, s.val)
			}
		}
		*t = *bigger
	}
	mask := uint64(len(t.slots) - 1)
	for i := t.home(key); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.key == emptyKey {
			t.n++
		}
		if s.key == key || s.key == emptyKey {
			s.key, s.val = key, val
			return
		}
	}
}

func (t *mergeTable) get(key uint64) (uint64, bool) {
	mask := uint64(len(t.slots) - 1)
	for i := t.home(key); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.key == key {
			return s.val, true
		}
		if s.key == emptyKey {
			return 0, false
		}
	}
}

// maxCachedPiece bounds the pieces the per-piece cache keeps (HF: 256).
const maxCachedPiece = 256

// appendPiece appends the ids of one pre-tokenized piece.
func (m *bpeModel) appendPiece(dst []uint32, piece string, sc *bpeScratch) []uint32 {
	if piece == "" || len(piece) > hotKeyLen {
		return m.appendPieceSlow(dst, piece, sc)
	}
	if sc.hot == nil {
		sc.hot = new(hotCache)
	}
	e := &sc.hot[fnv1a(piece)%hotEntries]
	if int(e.n) == len(piece) && string(e.key[:e.n]) == piece {
		return append(dst, e.ids[:e.cnt]...)
	}
	start := len(dst)
	dst = m.appendPieceSlow(dst, piece, sc)
	if ids := dst[start:]; len(ids) <= hotIDs {
		e.n = uint8(copy(e.key[:], piece))
		e.cnt = uint8(copy(e.ids[:], ids))
	}
	return dst
}

// shortKey packs a piece of 1 to 7 bytes and its length into a key that can
// never be emptyKey.
func shortKey(s string) uint64 {
	k := uint64(len(s)) << 56
	for i := 0; i < len(s); i++ {
		k |= uint64(s[i]) << (8 * i)
	}
	return k
}

// lookup finds a piece in the vocabulary (the value carries selfMerging).
func (m *bpeModel) lookup(piece string) (uint32, bool) {
	if len(piece) <= 7 && m.short != nil {
		v, ok := m.short.get(shortKey(piece))
		return uint32(v), ok
	}
	if m.tokens == nil { // still loading
		v, ok := m.vocab[piece]
		return v, ok
	}
	return m.tokens.get(piece)
}

// indexShort builds the short-piece table; call after vocab is final.
func (m *bpeModel) indexShort() {
	n := 0
	for tok := range m.vocab {
		if tok != "" && len(tok) <= 7 {
			n++
		}
	}
	m.short = newMergeTable(n)
	for tok, v := range m.vocab {
		if tok != "" && len(tok) <= 7 {
			m.short.set(shortKey(tok), uint64(v))
		}
	}
}

func (m *bpeModel) appendPieceSlow(dst []uint32, piece string, sc *bpeScratch) []uint32 {
	if piece == "" {
		return dst
	}
	if v, ok := m.lookup(piece); ok && (m.ignoreMerges || v&selfMerging != 0) {
		return append(dst, v&^selfMerging)
	}
	if m.byteLevel && len(piece) == 1 && m.byteIDs[piece[0]] >= 0 {
		return append(dst, uint32(m.byteIDs[piece[0]]))
	}
	useCache := m.cache != nil && len(piece) < maxCachedPiece
	if useCache {
		if ids, ok := m.cache.get(piece); ok {
			return append(dst, ids...)
		}
	}
	start := len(dst)
	m.initial(piece, sc)
	m.mergeAll(sc)
	for _, s := range sc.syms {
		if !s.removed {
			dst = append(dst, s.id)
		}
	}
	if useCache {
		m.cache.put(piece, dst[start:])
	}
	return dst
}

// initial fills sc.syms with the piece's characters as tokenizers'
// BPE::merge_word does: vocabulary ids, else <0xNN> byte tokens
// (byte_fallback), else the unk token (fused if fuse_unk), else nothing.
func (m *bpeModel) initial(piece string, sc *bpeScratch) {
	syms := sc.syms[:0]
	add := func(id uint32) {
		syms = append(syms, symbol{id: id})
	}
	pendingUnk := false
	miss := func(s string) {
		if m.byteFallback {
			ok := true
			for k := 0; k < len(s); k++ {
				if m.fallbackIDs[s[k]] < 0 {
					ok = false
					break
				}
			}
			if ok {
				for k := 0; k < len(s); k++ {
					add(uint32(m.fallbackIDs[s[k]]))
				}
				return
			}
		}
		if m.unk >= 0 {
			if pendingUnk && !m.fuseUnk {
				add(uint32(m.unk))
			}
			pendingUnk = true
		}
	}
	hit := func(id uint32) {
		if pendingUnk {
			add(uint32(m.unk))
			pendingUnk = false
		}
		add(id)
	}
	if m.byteLevel {
		for k := 0; k < len(piece); k++ {
			if id := m.byteIDs[piece[k]]; id >= 0 {
				hit(uint32(id))
			} else {
				miss(string(byteLevelRune[piece[k]]))
			}
		}
	} else {
		for k, r := range piece {
			end := k + utf8.RuneLen(r)
			s := piece[k:end]
			if m.prefix != "" && k > 0 {
				s = m.prefix + s
			}
			if m.suffix != "" && end == len(piece) {
				s += m.suffix
			}
			if v, ok := m.lookup(s); ok {
				hit(v &^ selfMerging)
			} else {
				miss(s)
			}
		}
	}
	if pendingUnk {
		add(uint32(m.unk))
	}
	sc.syms = syms
}

func (m *bpeModel) mergeAll(sc *bpeScratch) {
	syms := sc.syms
	n := int32(len(syms))
	for i := range syms {
		syms[i].prev = int32(i) - 1
		syms[i].next = int32(i) + 1
	}
	if n > 0 {
		syms[n-1].next = -1
	}
	h := sc.heap[:0]
	for i := int32(0); i+1 < n; i++ {
		if v, ok := m.merges.get(pairKey(syms[i].id, syms[i+1].id)); ok {
			h = heapPush(h, mergeEntry{v&^0xFFFFFFFF | uint64(i), uint32(v), syms[i].id, syms[i+1].id})
		}
	}
	for len(h) > 0 {
		var top mergeEntry
		top, h = heapPop(h)
		pos := int32(uint32(top.key))
		cur := &syms[pos]
		if cur.removed || cur.next < 0 {
			continue
		}
		next := cur.next
		if cur.id != top.left || syms[next].id != top.right {
			// One side changed since this was queued. HF's test is whether
			// the pair now there merges into the same token.
			v, ok := m.merges.get(pairKey(cur.id, syms[next].id))
			if !ok || uint32(v) != top.newID {
				continue
			}
		}
		cur.id = top.newID
		syms[next].removed = true
		cur.next = syms[next].next
		if cur.next >= 0 {
			syms[cur.next].prev = pos
		}
		if p := cur.prev; p >= 0 {
			if v, ok := m.merges.get(pairKey(syms[p].id, cur.id)); ok {
				h = heapPush(h, mergeEntry{v&^0xFFFFFFFF | uint64(p), uint32(v), syms[p].id, cur.id})
			}
		}
		if nx := cur.next; nx >= 0 {
			if v, ok := m.merges.get(pairKey(cur.id, syms[nx].id)); ok {
				h = heapPush(h, mergeEntry{v&^0xFFFFFFFF | uint64(pos), uint32(v), cur.id, syms[nx].id})
			}
		}
	}
	sc.heap = h
}

func heapPush(h []mergeEntry, e mergeEntry) []mergeEntry {
	h = append(h, e)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if h[p].key <= h[i].key {
			break
		}
		h[p], h[i] = h[i], h[p]
		i = p
	}
	return h
}

func heapPop(h []mergeEntry) (mergeEntry, []mergeEntry) {
	top := h[0]
	last := len(h) - 1
	h[0] = h[last]
	h = h[:last]
	i := 0
	for {
		l := 2*i + 1
		if l >= len(h) {
			break
		}
		small := l
		if r := l + 1; r < len(h) && h[r].key < h[l].key {
			small = r
		}
		if h[i].key <= h[small].key {
			break
		}
		h[i], h[small] = h[small], h[i]
		i = small
	}
	return top, h
}

// byteLevelRune is GPT-2's bytes_to_unicode: printable bytes stand for
// themselves, the others for the code points from U+0100 on.
var byteLevelRune = func() (t [256]rune) {
	n := rune(0)
	for b := 0; b < 256; b++ {
		if ('!' <= b && b <= '~') || (0xA1 <= b && b <= 0xAC) || (0xAE <= b && b <= 0xFF) {
			t[b] = rune(b)
		} else {
			t[b] = 256 + n
			n++
		}
	}
	return t
}()

// byteLevelDecode undoes the byte-to-char map, or reports false for text
// with characters outside it.
func byteLevelDecode(s string, inv map[rune]byte) (string, bool) {
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range s {
		c, ok := inv[r]
		if !ok {
			return "", false
		}
		b.WriteByte(c)
	}
	return b.String(), true
}

// pieceCache remembers the ids of recent pieces (bounded, sharded; a full
// shard starts over). HF keeps a similar 10,000-word cache.
type pieceCache struct {
	shards [16]pieceShard
	limit  int // entries per shard
}

type pieceShard struct {
	mu sync.RWMutex
	m  map[string][]uint32
}

func newPieceCache(entries int) *pieceCache {
	c := &pieceCache{limit: max(entries/16, 1)}
	for i := range c.shards {
		c.shards[i].m = make(map[string][]uint32)
	}
	return c
}

func (c *pieceCache) shard(s string) *pieceShard {
	return &c.shards[xxhash.Sum64String(s)&15]
}

func (c *pieceCache) get(s string) ([]uint32, bool) {
	sh := c.shard(s)
	sh.mu.RLock()
	ids, ok := sh.m[s]
	sh.mu.RUnlock()
	return ids, ok
}

func (c *pieceCache) put(s string, ids []uint32) {
	sh := c.shard(s)
	own := append([]uint32(nil), ids...)
	key := strings.Clone(s) // never pin the caller's text
	sh.mu.Lock()
	if len(sh.m) >= c.limit {
		clear(sh.m)
	}
	sh.m[key] = own
	sh.mu.Unlock()
}
