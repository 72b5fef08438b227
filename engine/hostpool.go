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
// CPU backend and LRU policy (vllm/v1/kv_offload: LRUOffloadingManager,
// v0.26 line): every block the GPU pool caches is also stored here
// (write-through, as the connector stores each block once it is computed),
// so a block the GPU pool evicts stays loadable from here until this pool,
// full, evicts its least recently used block to store a new one. Blocks
// are keyed by their engine hash, one offloaded block per GPU block
// (offloaded block size = GPU block size).
type hostPool struct {
	capacity int
	lru      *list.List // of uint64 hashes, front = least recently used
	at       map[uint64]*list.Element
	events   []kvevents.Event
	// blockSize is what the connector's BlockStored events carry.
	blockSize int
}

func newHostPool(capacity, blockSize int) *hostPool {
	return &hostPool{capacity: capacity, lru: list.New(), at: make(map[uint64]*list.Element, capacity), blockSize: blockSize}
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

// store offloads the blocks of hashes not held yet, as the connector's
// prepare_store does for one store job: it evicts the least recently used
// blocks to make room, and stores nothing when the job alone exceeds the
// pool. It records the events the connector sends for the job: a
// BlockRemoved of the evicted blocks, then a BlockStored of the stored
// ones, both on medium CPU. The connector's BlockStored names the blocks by
// hash alone: no parent, no tokens (the GPU BlockStored of the same hashes
// carried those), its block size, no LoRA fields, no group index.
func (h *hostPool) store(hashes []uint64) {
	var stored []uint64
	for _, x := range hashes {
		if !h.has(x) { // a chain's hashes are distinct
			stored = append(stored, x)
		}
	}
	if len(stored) == 0 || len(stored) > h.capacity {
		return
	}
	if n := h.lru.Len() + len(stored) - h.capacity; n > 0 {
		evicted := make([]uint64, 0, n)
		for range n {
			old := h.lru.Remove(h.lru.Front()).(uint64)
			delete(h.at, old)
			evicted = append(evicted, old)
		}
		h.events = append(h.events, kvevents.Event{Kind: kvevents.KindBlockRemoved, BlockHashes: evicted, Medium: mediumCPU})
	}
	for _, x := range stored {
		h.at[x] = h.lru.PushBack(x)
	}
	h.events = append(h.events, kvevents.Event{Kind: kvevents.KindBlockStored, BlockHashes: stored, BlockSize: h.blockSize, Medium: mediumCPU})
}

// reset forgets every offloaded block.
func (h *hostPool) reset() {
	h.lru.Init()
	clear(h.at)
}

// takeEvents returns and clears the recorded events.
func (h *hostPool) takeEvents() []kvevents.Event {
	ev := h.events
	h.events = nil
	return ev
}
