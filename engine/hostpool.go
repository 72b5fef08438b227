package engine

import (
	"container/list"

	"github.com/kvmesh/kvmesh/kvevents"
)

// DefaultCPULoadUsPerToken prices loading KV back from the host tier: a
// Llama-3-8B-shaped model holds 131,072 bytes of KV per token
// (../shared/calibration), and an H200's host link is PCIe Gen5 x16, 32 GT/s
// × 16 lanes with 128b/130b coding ≈ 63 GB/s per direction, of which pinned
// DMA copies reach about 80 %, ≈ 50 GB/s: 131,072 B / 50 GB/s ≈ 2.6 µs per
// token, about a tenth of the 28.2 µs per token prefill costs
// (DefaultCost). Not measured here; a profile parameter like the floor.
const DefaultCPULoadUsPerToken = 2.6

// mediumCPU is the medium vLLM's OffloadingConnector names its CPU backend
// in events (CPUOffloadingSpec, medium "CPU").
const mediumCPU = "CPU"

// hostPool is the host-memory tier of vLLM's OffloadingConnector with its
// CPU backend and LRU policy (vllm/v1/kv_offload and
// distributed/kv_transfer/kv_connector/v1/offloading, read at vLLM main
// 030ea52e and at the v0.24+ OffloadingEventsTracker before its locality
// and ownership fields, which vLLM omits when unset). Every block the GPU
// pool caches is also stored here (write-through, as the connector stores
// each block once it is computed), so a block the GPU pool evicts stays
// loadable from here until this pool, full, evicts its least recently used
// block to store a new one. Blocks are keyed by their engine hash, one
// offloaded block per GPU block (offloaded block size = GPU block size,
// one block per chunk).
type hostPool struct {
	capacity int
	lru      *list.List // of uint64 hashes, front = least recently used
	at       map[uint64]*list.Element
	// pinned blocks are being loaded: not evictable (the manager's
	// ref_cnt, taken by prepare_load).
	pinned    map[uint64]int
	events    []kvevents.Event
	blockSize int
	// placeholders: BlockStored events without self_describing_kv_events.
	placeholders bool
}

func newHostPool(capacity, blockSize int, placeholders bool) *hostPool {
	return &hostPool{capacity: capacity, lru: list.New(), at: make(map[uint64]*list.Element, capacity),
		pinned: map[uint64]int{}, blockSize: blockSize, placeholders: placeholders}
}

func (h *hostPool) has(hash uint64) bool {
	_, ok := h.at[hash]
	return ok
}

// touch marks the held blocks among hashes most recently used, as the
// connector's lookup does for the blocks it is asked about.
func (h *hostPool) touch(hashes []uint64) {
	for _, x := range hashes {
		if el, ok := h.at[x]; ok {
			h.lru.MoveToBack(el)
		}
	}
}

// pin protects hashes from eviction while they are loaded.
func (h *hostPool) pin(hashes []uint64) {
	for _, x := range hashes {
		h.pinned[x]++
	}
}

func (h *hostPool) unpin(hashes []uint64) {
	for _, x := range hashes {
		if h.pinned[x]--; h.pinned[x] <= 0 {
			delete(h.pinned, x)
		}
	}
}

// store offloads blocks start… of a sequence's chain (its block hashes
// from the first; tokens its tokens) that the pool does not hold yet, as
// the connector's prepare_store does for one store job: it evicts the least
// recently used blocks not being loaded to make room, and stores nothing
// when it cannot make room for the whole job. It records the events the
// connector sends for the job (OffloadingEventsTracker, vLLM v0.24+): one
// BlockRemoved of the evicted blocks, then one BlockStored per stored
// block, both on medium CPU with group 0. With self_describing_kv_events a
// BlockStored carries what the GPU pool's BlockStored of the block carried
// but its extra_keys (the tracker leaves them out); without it, vLLM's
// default, a placeholder: the hash alone, no parent, no tokens, block size
// 0, which a consumer can key only from the same hash on another medium.
func (h *hostPool) store(chain []uint64, start int, tokens []uint32) {
	var stored []int
	for i := start; i < len(chain); i++ {
		if !h.has(chain[i]) { // a chain's hashes are distinct
			stored = append(stored, i)
		}
	}
	if len(stored) == 0 || len(stored) > h.capacity {
		return
	}
	if n := h.lru.Len() + len(stored) - h.capacity; n > 0 {
		var victims []*list.Element
		for el := h.lru.Front(); el != nil && len(victims) < n; el = el.Next() {
			if h.pinned[el.Value.(uint64)] == 0 {
				victims = append(victims, el)
			}
		}
		if len(victims) < n {
			return
		}
		evicted := make([]uint64, 0, n)
		for _, el := range victims {
			old := h.lru.Remove(el).(uint64)
			delete(h.at, old)
			evicted = append(evicted, old)
		}
		h.events = append(h.events, kvevents.Event{Kind: kvevents.KindBlockRemoved, BlockHashes: evicted,
			Medium: mediumCPU, HasGroupIdx: true})
	}
	bs := h.blockSize
	for _, i := range stored {
		h.at[chain[i]] = h.lru.PushBack(chain[i])
		if h.placeholders {
			h.events = append(h.events, kvevents.Event{Kind: kvevents.KindBlockStored, BlockHashes: chain[i : i+1 : i+1],
				Medium: mediumCPU, HasGroupIdx: true})
			continue
		}
		ev := kvevents.Event{
			Kind:        kvevents.KindBlockStored,
			BlockHashes: chain[i : i+1 : i+1],
			TokenIDs:    tokens[i*bs : (i+1)*bs : (i+1)*bs],
			BlockSize:   bs,
			Medium:      mediumCPU,
			HasGroupIdx: true,
			SpecKind:    "full_attention",
		}
		if i > 0 {
			ev.ParentHash, ev.HasParent = chain[i-1], true
		}
		h.events = append(h.events, ev)
	}
}

// reset forgets every offloaded block.
func (h *hostPool) reset() {
	h.lru.Init()
	clear(h.at)
	clear(h.pinned)
}

// takeEvents returns and clears the recorded events.
func (h *hostPool) takeEvents() []kvevents.Event {
	ev := h.events
	h.events = nil
	return ev
}
