// Package residentset keeps a sidecar's exact set of resident kvmesh block
// keys from an engine's KV-cache events.
//
// Engines name blocks by their own hashes, which kvmesh does not reproduce;
// a BlockStored event carries the tokens, so the set computes each block's
// kvmesh key (package blockkey) by chaining from its parent's key, and keeps
// engine hash → key so a BlockRemoved, which carries hashes only, can be
// applied. A block whose parent is unknown cannot be keyed and is counted as
// an orphan, never guessed. The set is a pure state machine: events in, key
// transitions out through an Observer; no I/O, no clocks.
//
// Key_0 of a prefix comes from the LoRA adapter (name, else numeric id) and
// the cache salt (SGLang's field, or vLLM's extra keys of the first block),
// as the router seeds it. Blocks whose extra keys hold more than that
// (images, prompt embeddings) are tracked but keyless, with everything
// chained after them: their tokens do not say what they hold.
//
// Engine hashes are reference-counted per (medium, KV-cache group), as the
// engine counts them, and a key is resident while any counted medium and
// group holds a block with it. For hybrid models (sliding-window groups)
// that can overstate a hit; it never invents a prefix that no group holds.
//
// The set is bounded, since its events may come from anyone who reaches the
// event socket: at most Options.MaxBlocks engine hashes (the engine's
// capacity with slack) and KV-cache groups below Options.MaxGroups. A store
// past either bound is refused and counted, never evicting what is held: a
// refused block only makes routers predict a miss there (hit rate, not
// correctness), while the blocks already held stay exact for the removals
// that will name them. An honest engine never holds more blocks than its
// capacity, so a full set means the engine (or whoever speaks for it)
// misbehaves or removals were lost; Overfull says so until the next clear.
//
// Offload tiers (Options.Offload: vLLM's OffloadingConnector and LMCache
// publish blocks on "CPU" and disk media) are kept apart: a key held on a
// GPU medium is published as itself, and a key held only on an offload
// tier under blockkey.Tiered(key, blockkey.TierSalt(medium)), so that the
// Observer, and the one filter it feeds, tell a router what a hit there
// costs (a load from host memory: dearer than a GPU hit, far cheaper than
// recomputing). Salting in the same filter needs no new message kind, no
// second filter stream and no change to its deltas and generations; a
// router that knows no tiers simply never finds those keys. A key is
// published once, under its cheapest tier (write-through offloading holds
// every GPU block on the host too), so the published keys never outnumber
// the blocks of both tiers: the filter's size bound holds. A block moving
// between tiers (evicted from the GPU, still on the host) is one Removed and
// one Added.
package residentset

import (
	"strconv"
	"strings"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Observer hears every change of the resident key set, in order.
type Observer interface {
	// Added is called once when key becomes resident.
	Added(key uint64)
	// Removed is called once when key stops being resident.
	Removed(key uint64)
	// Cleared is called when every key stops being resident at once.
	Cleared()
}

// Options configure a Set.
type Options struct {
	// Media lists the storage tiers whose blocks count as resident,
	// compared case-insensitively; an event without a medium is on "GPU".
	// Empty means GPU only. Events on media neither here nor in Offload
	// are counted and ignored.
	Media []string
	// Offload lists the offload tiers, in order of preference (the cheapest
	// to load from first): their blocks are resident too, and a key held on
	// no Media tier is published as blockkey.Tiered under the first of
	// these that holds it. Compared case-insensitively.
	Offload []string
	// LoRANames names adapters by the numeric lora_id that vLLM before
	// v0.14 sends alone. Routers seed an adapter's keys with its name, so
	// without this map such blocks are keyed by the id and never match.
	LoRANames map[int64]string
	// MaxBlocks bounds the engine hashes held over every counted medium and
	// group (duplicates of a held hash are reference-counted and take no
	// more); a store past it is refused. 0 means no bound.
	MaxBlocks int
	// MaxGroups bounds group_idx: events of a group outside [0, MaxGroups)
	// are refused, so an outsider cannot make every lookup of an unknown
	// parent walk thousands of groups. 0 means DefaultMaxGroups.
	MaxGroups int
}

// DefaultMaxGroups is far above the KV-cache groups of real hybrid models
// (vLLM groups layers by attention type into groups of equal size: two for
// alternating sliding windows, six for Gemma 3's 5:1, eight for 1:7 Mamba
// hybrids).
const DefaultMaxGroups = 64

// Stats count what the set did with the events it was given.
type Stats struct {
	Events        uint64 // events applied
	StoredBlocks  uint64 // blocks of BlockStored events on counted media
	RemovedBlocks uint64 // blocks of BlockRemoved events on counted media
	Orphans       uint64 // stored blocks whose parent was unknown (never keyed)
	Unkeyed       uint64 // stored blocks without a full block of tokens and not known on another medium
	// Blocks resident without a kvmesh key: their extra keys (images,
	// embeddings) are more than their tokens, or they follow such a block
	// in the same event (ExtraKeyed), or an earlier event's (KeylessDescendants).
	ExtraKeyed         uint64
	KeylessDescendants uint64
	Duplicates         uint64 // stores of an engine hash already resident (reference counted)
	Conflicts          uint64 // duplicates whose tokens gave another key than the first store (first kept)
	UnknownRemovals    uint64 // removals of an engine hash not resident (ignored)
	OtherMedia         uint64 // blocks on media that do not count (ignored)
	Clears             uint64 // AllBlocksCleared events
	Resets             uint64 // Reset calls
	Unknown            uint64 // events of a kind this package does not know (ignored)
	// Blocks refused: stored past MaxBlocks (the set was full; later blocks
	// of the same event are refused with the first), or stored or removed
	// in a group outside [0, MaxGroups).
	RefusedFull  uint64
	RefusedGroup uint64
}

// tierID names one engine block namespace: the engine reference-counts
// hashes per medium and KV-cache group.
type tierID struct {
	medium string
	group  int
}

// Set is the exact resident set of one engine. It is not safe for concurrent
// use; the sidecar's event loop owns it.
type Set struct {
	media     []string
	loraNames map[int64]string

	tiers     map[tierID]*hashIndex // engine hash → key and stores not yet removed; no empty tier
	keys      keyCounts             // kvmesh key → resident engine hashes naming it on Media
	offload   []offloadTier         // the Offload tiers, in order
	published int                   // keys published (resident on any counted medium)
	blockSize int
	stats     Stats

	maxBlocks, maxGroups int
	blocks               int  // engine hashes held, over every tier
	overfull             bool // a store was refused as past MaxBlocks since the last clear
}

// New returns an empty set.
func New(opts Options) *Set {
	s := &Set{tiers: make(map[tierID]*hashIndex), loraNames: opts.LoRANames,
		maxBlocks: opts.MaxBlocks, maxGroups: opts.MaxGroups}
	if s.maxGroups <= 0 {
		s.maxGroups = DefaultMaxGroups
	}
	for _, m := range opts.Media {
		s.media = append(s.media, normMedium(m))
	}
	if len(s.media) == 0 {
		s.media = []string{"GPU"}
	}
	for _, m := range opts.Offload {
		if m = normMedium(m); s.class(m) < 0 {
			s.offload = append(s.offload, offloadTier{medium: m, salt: blockkey.TierSalt(m)})
		}
	}
	return s
}

func normMedium(m string) string {
	if m == "" {
		return "GPU"
	}
	return strings.ToUpper(m)
}

// counts reports whether blocks on medium (normalised) are resident.
func (s *Set) counts(medium string) bool {
	for _, m := range s.media {
		if m == medium {
			return true
		}
	}
	return false
}

// offloadTier is one offload medium: its keys, counted as s.keys are.
type offloadTier struct {
	medium string
	salt   uint64
	keys   keyCounts
}

// class is where blocks on medium (normalised) count: 0 on Media, j+1 on
// Offload[j], -1 nowhere.
func (s *Set) class(medium string) int {
	if s.counts(medium) {
		return 0
	}
	for j := range s.offload {
		if s.offload[j].medium == medium {
			return j + 1
		}
	}
	return -1
}

func (s *Set) keysOf(class int) *keyCounts {
	if class == 0 {
		return &s.keys
	}
	return &s.offload[class-1].keys
}

// publishedAs is the key key is published under, and whether it is.
func (s *Set) publishedAs(key uint64) (uint64, bool) {
	if s.keys.contains(key) {
		return key, true
	}
	for j := range s.offload {
		if t := &s.offload[j]; t.keys.contains(key) {
			return blockkey.Tiered(key, t.salt), true
		}
	}
	return 0, false
}

// inc counts one more hash naming key in class and tells obs how that
// changed what key is published as.
func (s *Set) inc(class int, key uint64, obs Observer) {
	kc := s.keysOf(class)
	if len(s.offload) == 0 {
		if kc.inc(key) {
			s.published++
			obs.Added(key)
		}
		return
	}
	if kc.contains(key) {
		kc.inc(key)
		return
	}
	before, was := s.publishedAs(key)
	kc.inc(key)
	s.republish(key, before, was, obs)
}

// dec counts one hash fewer naming key in class, as inc does.
func (s *Set) dec(class int, key uint64, obs Observer) {
	kc := s.keysOf(class)
	if len(s.offload) == 0 {
		if kc.dec(key) {
			s.published--
			obs.Removed(key)
		}
		return
	}
	if kc.count(key) > 1 {
		kc.dec(key)
		return
	}
	before, was := s.publishedAs(key)
	kc.dec(key)
	s.republish(key, before, was, obs)
}

// republish tells obs that key, published as before (when was), is now
// published as publishedAs says.
func (s *Set) republish(key, before uint64, was bool, obs Observer) {
	after, is := s.publishedAs(key)
	if was && is && before == after {
		return
	}
	if was {
		s.published--
		obs.Removed(before)
	}
	if is {
		s.published++
		obs.Added(after)
	}
}

type nopObserver struct{}

func (nopObserver) Added(uint64)   {}
func (nopObserver) Removed(uint64) {}
func (nopObserver) Cleared()       {}

// Apply applies one event; obs (may be nil) hears the resulting key changes.
func (s *Set) Apply(ev *kvevents.Event, obs Observer) {
	if obs == nil {
		obs = nopObserver{}
	}
	s.stats.Events++
	switch ev.Kind {
	case kvevents.KindBlockStored:
		s.store(ev, obs)
	case kvevents.KindBlockRemoved:
		s.remove(ev, obs)
	case kvevents.KindAllBlocksCleared:
		s.stats.Clears++
		s.clear(obs)
	default:
		s.stats.Unknown++
	}
}

// Reset empties the set: the engine restarted or its stream can no longer be
// trusted (a gap that replay could not fill).
func (s *Set) Reset(obs Observer) {
	if obs == nil {
		obs = nopObserver{}
	}
	s.stats.Resets++
	s.clear(obs)
}

func (s *Set) clear(obs Observer) {
	clear(s.tiers)
	s.keys.reset()
	for j := range s.offload {
		s.offload[j].keys.reset()
	}
	s.blocks, s.overfull, s.published = 0, false, 0
	obs.Cleared()
}

// SetMaxBlocks changes the bound on engine hashes held (0: none), e.g. when
// the engine reports its capacity. Lowering it below what is held drops
// nothing: stores are refused until removals bring the set under it.
func (s *Set) SetMaxBlocks(n int) { s.maxBlocks = n }

// groupRefused counts, and reports, an event of a group outside the bound.
func (s *Set) groupRefused(ev *kvevents.Event) bool {
	if ev.GroupIdx >= 0 && ev.GroupIdx < s.maxGroups {
		return false
	}
	s.stats.RefusedGroup += uint64(len(ev.BlockHashes))
	return true
}

// seed is key_0 of a stored prefix that starts at the beginning: the LoRA
// adapter's name (from the configured names when the engine sent only an
// id, else the id itself) and the cache salt.
func (s *Set) seed(ev *kvevents.Event, salt string) uint64 {
	adapter := ev.LoRAName
	if adapter == "" && ev.LoRAID != 0 {
		if adapter = s.loraNames[ev.LoRAID]; adapter == "" {
			adapter = strconv.FormatInt(ev.LoRAID, 10)
		}
	}
	return blockkey.Seed(adapter, salt)
}

// taint marks, in an entry's reference count, an engine hash that is
// resident but has no kvmesh key: its content is more than its tokens (extra
// keys) or its tokens were not sent. Its children are tainted too, instead
// of passing for orphans (which would suggest lost events).
const taint = 1 << 31

func (s *Set) store(ev *kvevents.Event, obs Observer) {
	n := uint64(len(ev.BlockHashes))
	medium := normMedium(ev.Medium)
	class := s.class(medium)
	if class < 0 {
		s.stats.OtherMedia += n
		return
	}
	s.stats.StoredBlocks += n
	if s.groupRefused(ev) {
		return
	}
	if ev.BlockSize > 0 {
		s.blockSize = ev.BlockSize
	}
	id := tierID{medium, ev.GroupIdx}
	if ev.HasParent && ev.ParentHash == 0 {
		// Publishers of vLLM's array layout that are not vLLM (llm-d's
		// inference simulator among them) send parent 0 for "no parent", as
		// llm-d's consumers read it; vLLM sends nil. Parent 0 is therefore
		// no parent unless a block hashed 0 is resident (a 2^-64 chance for
		// a real hash), whatever the layout.
		if _, _, ok := s.lookup(id, 0); !ok {
			root := *ev // the caller's event stays as decoded
			root.HasParent = false
			ev = &root
		}
	}
	salt, keyable := ev.CacheSalt, len(ev.BlockHashes)
	if len(ev.ExtraKeys) > 0 {
		var extraSalt string
		extraSalt, keyable = extraKeys(ev)
		if salt == "" {
			salt = extraSalt
		}
	}
	parent := s.seed(ev, salt)
	tainted := false
	if ev.HasParent {
		var ok bool
		if parent, tainted, ok = s.lookup(id, ev.ParentHash); !ok {
			s.stats.Orphans += n
			return
		}
		if tainted {
			s.stats.KeylessDescendants += n
		}
	}
	t := s.tiers[id]
	if t == nil {
		t = new(hashIndex)
		s.tiers[id] = t
		defer s.dropIfEmpty(id, t) // the event may be refused
	}
	bs := ev.BlockSize
	if bs <= 0 {
		bs = s.blockSize
	}
	tokens := ev.TokenIDs
	for i, h := range ev.BlockHashes {
		var key uint64
		switch {
		case tainted:
		case i >= keyable:
			tainted = true
			s.stats.ExtraKeyed += n - uint64(i)
		case bs > 0 && len(tokens) >= (i+1)*bs:
			key = blockkey.Next(parent, tokens[i*bs:(i+1)*bs])
		default:
			// No tokens (e.g. an offload event): the same engine hash on
			// another medium names the same block.
			var ok bool
			if key, tainted, ok = s.lookup(id, h); !ok || tainted {
				tainted = true
				s.stats.Unkeyed += n - uint64(i)
			}
		}
		if !s.add(t, class, h, key, tainted, obs) {
			s.stats.RefusedFull += n - uint64(i)
			s.overfull = true
			return
		}
		parent = key
	}
}

// lookup finds the key of engine hash h, preferring tier id; tainted is
// true for a known hash without a key.
func (s *Set) lookup(id tierID, h uint64) (key uint64, tainted, ok bool) {
	if t := s.tiers[id]; t != nil {
		if e, ok := t.get(h); ok {
			return e.key(), e.refs&taint != 0, true
		}
	}
	for other, t := range s.tiers {
		if other == id {
			continue
		}
		if e, ok := t.get(h); ok {
			return e.key(), e.refs&taint != 0, true
		}
	}
	return 0, false, false
}

// add stores h in t, or reports false when that needs a slot past MaxBlocks.
func (s *Set) add(t *hashIndex, class int, h, key uint64, tainted bool, obs Observer) bool {
	if e, ok := t.get(h); ok {
		s.stats.Duplicates++
		if e.key() != key || (e.refs&taint != 0) != tainted {
			s.stats.Conflicts++ // keep the first: its removal must match
		}
		if e.refs&^taint < taint-1 {
			e.refs++
		}
		t.put(h, e)
		return true
	}
	if s.maxBlocks > 0 && s.blocks >= s.maxBlocks {
		return false
	}
	s.blocks++
	if tainted {
		t.put(h, entry(0, 1|taint))
		return true
	}
	t.put(h, entry(key, 1))
	s.inc(class, key, obs)
	return true
}

func (s *Set) remove(ev *kvevents.Event, obs Observer) {
	n := uint64(len(ev.BlockHashes))
	medium := normMedium(ev.Medium)
	class := s.class(medium)
	if class < 0 {
		s.stats.OtherMedia += n
		return
	}
	s.stats.RemovedBlocks += n
	if s.groupRefused(ev) {
		return
	}
	id := tierID{medium, ev.GroupIdx}
	t := s.tiers[id]
	for _, h := range ev.BlockHashes {
		var e hashEntry
		ok := false
		if t != nil {
			e, ok = t.get(h)
		}
		switch {
		case !ok:
			s.stats.UnknownRemovals++
		case e.refs&^taint > 1:
			e.refs--
			t.put(h, e)
		default:
			t.del(h)
			s.blocks--
			if e.refs&taint == 0 {
				s.dec(class, e.key(), obs)
			}
		}
	}
	if t != nil {
		s.dropIfEmpty(id, t)
	}
}

// dropIfEmpty forgets an empty tier: lookups of an unknown parent walk
// every tier.
func (s *Set) dropIfEmpty(id tierID, t *hashIndex) {
	if t.len() == 0 {
		delete(s.tiers, id)
	}
}

// Len is the number of resident kvmesh keys, on any counted medium.
func (s *Set) Len() int { return s.published }

// Blocks is the number of engine hashes held, over every counted medium and
// group: what MaxBlocks bounds.
func (s *Set) Blocks() int { return s.blocks }

// Overfull reports whether a store was refused as past MaxBlocks since the
// last clear or reset: the engine claimed more blocks than it can hold.
func (s *Set) Overfull() bool { return s.overfull }

// Orphans counts stored blocks whose parent was unknown, so they were never
// keyed.
func (s *Set) Orphans() uint64 { return s.stats.Orphans }

// BlockSize is the engine's block size in tokens as the last BlockStored
// gave it; 0 before any.
func (s *Set) BlockSize() int { return s.blockSize }

// Stats returns the event counters.
func (s *Set) Stats() Stats { return s.stats }

// Contains reports whether key is resident on a Media tier (GPU).
func (s *Set) Contains(key uint64) bool { return s.keys.contains(key) }

// Published reports the key under which key is published (itself on GPU,
// blockkey.Tiered for an offload tier only) and whether it is resident.
func (s *Set) Published(key uint64) (uint64, bool) { return s.publishedAs(key) }

// AppendKeys appends every resident key to dst as it is published (a key
// held only on an offload tier as its blockkey.Tiered), once each, in no
// particular order (a sidecar copies the set under its lock to rebuild a
// filter outside it).
func (s *Set) AppendKeys(dst []uint64) []uint64 {
	dst = s.keys.appendTo(dst)
	for j := range s.offload {
		t := &s.offload[j]
		from := len(dst)
		dst = t.keys.appendTo(dst)
		kept := from
		for _, k := range dst[from:] {
			if p, _ := s.publishedAs(k); p == blockkey.Tiered(k, t.salt) {
				dst[kept] = p
				kept++
			}
		}
		dst = dst[:kept]
	}
	return dst
}
