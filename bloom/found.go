package bloom

import "sync/atomic"

// foundPrefixes remembers the last few key prefixes MatchPrefix found in a
// filter, so that the next walk of a prompt sharing one (the same system
// prompt, an earlier turn of the conversation) starts where it ended. A
// filter only ever gains bits, so every key of a prefix found once tests
// positive again: skipping them changes no result, only the time (a shared
// 3,500-token system prompt is 220 probes per replica holding it).
//
// A prefix is stored as the key of its last block and its length in blocks.
// Keys are chained (package blockkey: each covers every block before it),
// so a prompt whose key at that length is the stored one shares the whole
// prefix. The two halves of a slot are written separately, without a lock:
// a reader (or a slot two writers raced on) pairing one write's key with
// another's length can only match a prompt whose key at that length is a
// key found at another length — a collision of chained keys.
type foundPrefixes struct {
	slots [foundSlots]struct{ key, blocks atomic.Uint64 }
	next  atomic.Uint32 // the slot the next new prefix replaces
}

const foundSlots = 4

// longest returns the length of the longest remembered prefix keys starts
// with (0 if none) and its slot (-1 if none).
func (f *foundPrefixes) longest(keys []uint64) (blocks, slot int) {
	slot = -1
	for i := range f.slots {
		s := &f.slots[i]
		n := int(s.blocks.Load()) // before key: see the type's comment
		if n > blocks && n <= len(keys) && keys[n-1] == s.key.Load() {
			blocks, slot = n, i
		}
	}
	return blocks, slot
}

// add remembers that the filter holds the n-block prefix ending with key.
// It goes in slot when that held a shorter prefix of the same prompt (a
// conversation that grew, a system prompt now followed by a cached turn),
// else replaces the slot written longest ago.
func (f *foundPrefixes) add(key uint64, n, slot int) {
	if slot < 0 {
		slot = int((f.next.Add(1) - 1) % foundSlots) // in uint32: never negative
	}
	s := &f.slots[slot]
	s.key.Store(key)
	s.blocks.Store(uint64(n))
}
