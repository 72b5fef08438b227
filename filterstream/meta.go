package filterstream

import (
	"errors"
	"fmt"
)

// Role is what a cluster member does.
type Role uint8

const (
	RoleUnknown Role = iota // not a member DecodeMeta accepts
	RoleSidecar             // one per engine replica: sends its load and filter
	RoleRouter              // routes requests: receives every sidecar's stream
)

// String names the role as member names start with ("sidecar/a").
func (r Role) String() string {
	switch r {
	case RoleSidecar:
		return "sidecar"
	case RoleRouter:
		return "router"
	}
	return "unknown"
}

// Capability bits a member announces.
const (
	// CapKVEvents: the sidecar feeds resident blocks (filters), not only load.
	CapKVEvents uint32 = 1 << iota
	// CapInflight: the sidecar sums routers' in-flight reports into its load.
	CapInflight
	// CapInflightOthers, announced by both sides: the sidecar's load records
	// for such a router count only the other routers' in-flight work. The
	// router adds its own exact counts, where it would otherwise take its
	// last report out of a sum that may have been made before it arrived
	// (and so count a request that had already finished).
	CapInflightOthers
	// CapTenantUsage: the router reads other routers' per-tenant usage
	// (KindTenantUsage) to enforce quotas across the cluster.
	CapTenantUsage
	// CapTiers: the sidecar publishes blocks held only on an offload tier
	// (Meta.OffloadMedia) under blockkey.Tiered keys in its filter.
	CapTiers
)

const metaVersion = 1

// MetaMaxSize is the most metadata a member may announce: memberlist's
// limit (memberlist.MetaMaxSize), past which it panics.
const MetaMaxSize = 512

// Meta is a member's node metadata, gossiped with its alive messages. It
// changes rarely (models learned, engine URL): load never rides here.
type Meta struct {
	Role          Role
	Name          string // replica name for a sidecar, router name for a router
	Models        []string
	EngineURL     string
	Protocol      string // fleet.ProtocolVLLM or fleet.ProtocolSGLang
	BlockSize     int
	SchemeVersion int // blockkey.SchemeVersion the keys were computed with
	Capabilities  uint32
	Epoch         uint64 // boot epoch of the sender
	// DataParallel is set when the sidecar follows one data-parallel rank
	// (DataParallelRank) of the engine server at EngineURL: that server's
	// ranks share its URL, each with its own KV cache, and a request
	// reaches this rank's cache only when it names the rank
	// (X-data-parallel-rank).
	DataParallel     bool
	DataParallelRank int
	// OffloadMedia are the offload tiers (upper case, e.g. "CPU") whose
	// blocks the sidecar's filter holds under blockkey.Tiered keys, in the
	// order it prefers them (announced with CapTiers).
	OffloadMedia []string
	// KVRole is the engine's side of prefill/decode disaggregation
	// (fleet.KVRole: 0 both, 1 prefill, 2 decode).
	KVRole uint8
}

// maxKVRole is the largest role metadata carries: a role a later build
// adds is read as both (served whole), which every engine can do.
const maxKVRole = 2

// MaxOffloadMedia bounds the offload tiers metadata carries, and
// maxMediumName the length of each name.
const (
	MaxOffloadMedia = 8
	maxMediumName   = 32
)

// MaxDataParallelRank bounds the rank metadata carries (vLLM's ranks are
// a few hundred at most).
const MaxDataParallelRank = 1 << 16

// ErrMetaTooLarge is returned when metadata cannot fit MetaMaxSize even
// with every model name dropped.
var ErrMetaTooLarge = errors.New("filterstream: node metadata over 512 bytes")

// Encode returns m in at most MetaMaxSize bytes. Models that do not
// fit are left out (their count is returned), since a node whose metadata
// grows past the limit would make memberlist panic.
func (m *Meta) Encode() ([]byte, int, error) {
	for keep := len(m.Models); keep >= 0; keep-- {
		b := m.encode(m.Models[:keep])
		if len(b) <= MetaMaxSize {
			return b, len(m.Models) - keep, nil
		}
	}
	return nil, len(m.Models), ErrMetaTooLarge
}

func (m *Meta) encode(models []string) []byte {
	w := writer{b: make([]byte, 0, 128)}
	w.byte(metaVersion)
	w.byte(byte(m.Role))
	w.str(m.Name)
	w.uvarint(uint64(len(models)))
	for _, s := range models {
		w.str(s)
	}
	w.str(m.EngineURL)
	w.str(m.Protocol)
	w.uvarint(uint64(m.BlockSize))
	w.uvarint(uint64(m.SchemeVersion))
	w.uvarint(uint64(m.Capabilities))
	w.u64(m.Epoch)
	// Appended field: rank+1, 0 when not data-parallel. Always written,
	// so that a field appended later never follows an absent one; builds
	// that predate it stop reading at Epoch.
	dp := uint64(0)
	if m.DataParallel {
		dp = uint64(m.DataParallelRank) + 1
	}
	w.uvarint(dp)
	// Appended field: the offload media, always written (count 0 for none).
	w.uvarint(uint64(len(m.OffloadMedia)))
	for _, md := range m.OffloadMedia {
		w.str(md)
	}
	// Appended field: the KV role, always written (0 for both).
	w.uvarint(uint64(m.KVRole))
	return w.b
}

// DecodeMeta parses metadata written by Encode, or by a build before the
// data-parallel rank, the offload media or the KV role were appended.
// Fields appended by later versions are ignored.
func DecodeMeta(b []byte) (Meta, error) {
	var m Meta
	r := reader{b: b}
	if v := r.byte(); r.err == nil && v != metaVersion {
		return m, fmt.Errorf("filterstream: metadata version %d, want %d", v, metaVersion)
	}
	m.Role = Role(r.byte())
	m.Name = r.str(255)
	n := r.int(MetaMaxSize)
	for i := 0; i < n && r.err == nil; i++ {
		m.Models = append(m.Models, r.str(MetaMaxSize))
	}
	m.EngineURL = r.str(MetaMaxSize)
	m.Protocol = r.str(64)
	m.BlockSize = r.int(1 << 20)
	m.SchemeVersion = r.int(1 << 20)
	m.Capabilities = uint32(r.int(1<<32 - 1))
	m.Epoch = r.u64()
	if r.err == nil && len(r.b) > 0 { // absent in metadata of earlier builds: not data-parallel
		if dp := r.int(MaxDataParallelRank + 1); dp > 0 {
			m.DataParallel, m.DataParallelRank = true, dp-1
		}
	}
	if r.err == nil && len(r.b) > 0 { // absent in metadata of earlier builds: no offload tiers
		n := r.int(MaxOffloadMedia)
		for i := 0; i < n && r.err == nil; i++ {
			m.OffloadMedia = append(m.OffloadMedia, r.str(maxMediumName))
		}
	}
	if r.err == nil && len(r.b) > 0 { // absent in metadata of earlier builds: both
		if role := r.int(1 << 16); role <= maxKVRole {
			m.KVRole = uint8(role)
		}
	}
	if r.err != nil {
		return Meta{}, r.err
	}
	if m.Role != RoleSidecar && m.Role != RoleRouter {
		return Meta{}, fmt.Errorf("filterstream: unknown role %d", m.Role)
	}
	if m.Name == "" {
		return Meta{}, errors.New("filterstream: metadata without a name")
	}
	return m, nil
}
