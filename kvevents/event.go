// Package kvevents speaks the KV-cache event protocol of vLLM and SGLang:
// msgpack KVEventBatch payloads carried in 3-frame ZMQ messages
// (topic, 8-byte big-endian sequence, payload), with a ROUTER replay endpoint.
//
// Decoding is tolerant the way the engines' history demands: array-like and
// map-encoded events, missing trailing fields, unknown extra fields and tags,
// and block hashes as signed or unsigned ints or as digest bytes (folded to
// their last 8 bytes, big-endian). Malformed input is an error, never a panic.
//
// DecodeBatch and AppendBatch are the codec (pure, allocation-free once a
// Batch is warm). Subscriber is the sidecar's long-running SUB client: it
// delivers batches in sequence order, fills gaps from the replay endpoint and
// turns what cannot be recovered (a publisher restart, a gap older than the
// replay ring) into a HandleReset instead of silent loss. Publisher is the
// engine side, for enginesim and tests.
package kvevents

// Kind tells which event an Event holds.
type Kind uint8

const (
	KindUnknown Kind = iota // an event tag this package does not know; skipped
	KindBlockStored
	KindBlockRemoved
	KindAllBlocksCleared
)

func (k Kind) String() string {
	switch k {
	case KindBlockStored:
		return "BlockStored"
	case KindBlockRemoved:
		return "BlockRemoved"
	case KindAllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "Unknown"
}

// Event is one KV-cache event. It is a flat struct rather than an interface so
// a decoder can reuse a batch's events (and their slices) without allocating.
type Event struct {
	Kind Kind

	// BlockHashes are the engine's hashes of the stored or removed blocks,
	// normalised to uint64 (BlockStored, BlockRemoved).
	BlockHashes []uint64

	// ParentHash is the engine hash of the block before BlockHashes[0];
	// HasParent is false for a prefix that starts at the beginning (BlockStored).
	ParentHash uint64
	HasParent  bool

	// TokenIDs are the tokens of all stored blocks, concatenated (BlockStored).
	TokenIDs []uint32
	// Bigram is set when the engine sent token_ids as (t[i], t[i+1]) pairs
	// (SGLang with EAGLE speculative decoding). TokenIDs then holds each
	// pair's first id — the blocks' own tokens — and BigramLast the second
	// id of the last pair, the token after them, so the event re-encodes as
	// it came.
	Bigram     bool
	BigramLast uint32
	// BlockSize is the engine's block size in tokens (BlockStored).
	BlockSize int

	// LoRAID and LoRAName identify the adapter the blocks belong to; zero
	// values for the base model (BlockStored).
	LoRAID   int64
	LoRAName string

	// Medium is the storage tier ("GPU", "CPU", ...); "" when the engine did
	// not say, which means GPU (BlockStored, BlockRemoved).
	Medium string

	// GroupIdx is the KV-cache group for hybrid models (BlockStored,
	// BlockRemoved); 0 when absent.
	GroupIdx int
	// HasGroupIdx tells whether the engine sent group_idx (vLLM >= #37688),
	// so an encoder can reproduce the producer's bytes.
	HasGroupIdx bool

	// CacheSalt is SGLang's per-request cache salt (BlockStored, map events
	// or the trailing metadata map); "" when unsalted. Salted blocks live in
	// their own hash chain.
	CacheSalt string

	// SpecKind and SlidingWindow are vLLM's kv_cache_spec_kind and
	// kv_cache_spec_sliding_window (BlockStored, >= #40984); zero when absent.
	SpecKind      string
	SlidingWindow int

	// ExtraKeys is the raw msgpack of vLLM's per-block extra_keys list
	// (BlockStored, >= #33304), kept verbatim because its tuples are
	// free-form; empty when absent.
	ExtraKeys []byte
}

// Batch is one KVEventBatch: [ts, events, data_parallel_rank].
type Batch struct {
	TS     float64
	Events []Event
	// DPRank is the data-parallel rank, -1 when the publisher sent none.
	DPRank int

	// held is the bytes the events' buffers hold for reuse, as of the last
	// decode; the next drops them all when they pass maxRetainedBytes.
	held int
}
