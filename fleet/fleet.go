// Package fleet is a router's view of the replicas it can route to: who they
// are, whether they are alive, how loaded and how warm they are, and how old
// that knowledge is. Gossip feeds a Table; each routing decision reads one
// cheap, consistent Snapshot of it.
package fleet

import (
	"fmt"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
)

// Protocol names what a replica speaks and how its state is known.
const (
	ProtocolVLLM   = "vllm"   // engine with a sidecar feeding KV events (vLLM or enginesim)
	ProtocolSGLang = "sglang" // SGLang engine with a sidecar
	ProtocolStatic = "static" // configured upstream without a sidecar: load-balanced only
)

// KVRole is the side of prefill/decode disaggregation a replica's engine
// plays (vLLM's --kv-transfer-config kv_role): a prefill engine computes
// prompts and hands their KV to a decode engine, which decodes. Its zero
// value is both: an engine that serves whole requests.
type KVRole uint8

// The roles.
const (
	KVBoth    KVRole = iota // kv_both: serves whole requests (and either side)
	KVPrefill               // kv_producer: prefills for remote decodes
	KVDecode                // kv_consumer: decodes remote prefills, or serves whole requests
)

// String names the role as the sidecar's --kv-role flag does.
func (r KVRole) String() string {
	switch r {
	case KVPrefill:
		return "prefill"
	case KVDecode:
		return "decode"
	}
	return "both"
}

// ParseKVRole reads a role by its name ("prefill", "decode", "both") or
// by vLLM's kv_role name (kv_producer, kv_consumer, kv_both).
func ParseKVRole(s string) (KVRole, error) {
	switch s {
	case "both", "kv_both", "":
		return KVBoth, nil
	case "prefill", "kv_producer":
		return KVPrefill, nil
	case "decode", "kv_consumer":
		return KVDecode, nil
	}
	return KVBoth, fmt.Errorf("KV role %q: want prefill, decode or both (or vLLM's kv_producer, kv_consumer, kv_both)", s)
}

// Prefills reports whether a replica of role r takes prefills for remote
// decodes; Decodes whether it takes requests to decode (remote prefills,
// or whole requests it prefills itself).
func (r KVRole) Prefills() bool { return r != KVDecode }
func (r KVRole) Decodes() bool  { return r != KVPrefill }

// Replica is one engine replica as a router knows it at one moment.
type Replica struct {
	Name     string
	Models   []string // served model names and LoRA adapters (from the engine's /v1/models)
	URL      string   // engine base URL, e.g. http://127.0.0.1:8000
	Protocol string
	// ModelsLearned is true when a static upstream's Models came from its
	// /v1/models (Table.LearnStatic) rather than its configuration, so they
	// are to be kept up to date.
	ModelsLearned bool
	// KVEvents is true when a sidecar feeds this replica's resident blocks.
	KVEvents bool
	// Selected is true when the replica takes part in prefix matching; an
	// unselected replica still receives traffic by load.
	Selected bool
	// Online is false once the engine is known to be down: its sidecar
	// says so or, for an orphan, it does not answer the router's health
	// probe. A replica whose sidecar left on purpose is removed.
	Online bool
	// Orphan is true when the replica's sidecar failed or fell silent: it
	// is routed by load only (no filter, no load figures) while its engine
	// answers, until the sidecar is heard again.
	Orphan bool
	// Stale is true when the replica's state is older than the table's TTL:
	// it is then routed by load only.
	Stale bool

	BlockSize int
	// DataParallel is set when the replica is one data-parallel rank,
	// DataParallelRank, of the engine server at URL: the ranks of one
	// server share its URL, each with its own KV cache, and a request
	// reaches this replica's cache only when it names the rank
	// (X-data-parallel-rank). URL is the server's identity.
	DataParallel     bool
	DataParallelRank int
	// OffloadMedia are the offload tiers (e.g. "CPU"), in the order its
	// sidecar prefers them, whose blocks its filter holds, when no GPU
	// holds them, under blockkey.Tiered(key, blockkey.TierSalt(medium)).
	OffloadMedia []string
	// KVRole is the side of prefill/decode disaggregation its engine plays.
	KVRole KVRole
	// Filter holds the replica's resident block keys; nil when unknown.
	// Read it only through Snapshot.MatchPrefix, which handles concurrency.
	Filter           *bloom.Filter
	FilterGeneration uint64
	FilterKeys       int

	Load Load
	// UpdatedAt is when the last state (load or filter) arrived.
	UpdatedAt time.Time
}

// Serves reports whether the replica serves model (a served name or adapter).
func (r *Replica) Serves(model string) bool {
	for _, m := range r.Models {
		if m == model {
			return true
		}
	}
	return false
}

// Load is a replica's live load: the engine's own counts plus what the
// cluster's routers have dispatched that the engine may not count yet.
type Load struct {
	Waiting int     // requests queued at the engine
	Running int     // requests running at the engine
	KVUsage float64 // fraction of KV cache in use, 0..1
	// OthersInflightRequests and OthersInflightPrefillTokens are the
	// requests (and their uncached prompt tokens) the other routers have
	// dispatched to this replica and not yet seen finish, as of the
	// sidecar's last load record; a router adds its own exact counts.
	OthersInflightRequests      int
	OthersInflightPrefillTokens int
}
