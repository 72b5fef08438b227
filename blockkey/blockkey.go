// Package blockkey computes kvmesh's chained 64-bit block keys.
//
// A key names a full block of token ids together with everything before it:
// key_i = H(key_{i-1}, tokens of block i), with key_0 a seed. Because keys are
// chained, finding block i's key in a replica's filter implies the whole prefix
// up to block i is resident there. The sidecar computes keys from the token ids
// that the engine's BlockStored events carry; the router computes them from the
// prompt it tokenized. Both sides use this package, so the scheme lives here
// and nowhere else.
package blockkey

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// SchemeVersion is gossiped in node metadata; routers ignore sidecars whose
// keys were computed with another scheme.
const SchemeVersion = 1

// baseSeed is key_0 for the base model. Served-model aliases do not change it:
// a router only compares a request with replicas serving its model anyway.
const baseSeed uint64 = 0x6b766d6573680001 // "kvmesh\x00\x01"

// Seed returns key_0 for a request. The base model (adapter "" and no cache
// salt) always gets the same seed; a LoRA adapter or a cache salt gets its own,
// so blocks the engine keeps apart never share keys.
func Seed(adapter, cacheSalt string) uint64 {
	if adapter == "" && cacheSalt == "" {
		return baseSeed
	}
	var d xxhash.Digest
	d.ResetWithSeed(baseSeed)
	_, _ = d.WriteString(adapter)
	_, _ = d.Write([]byte{0})
	_, _ = d.WriteString(cacheSalt)
	return d.Sum64()
}

// Next returns the key of a block whose parent block has key parent.
func Next(parent uint64, block []uint32) uint64 {
	var d xxhash.Digest
	d.ResetWithSeed(parent)
	var buf [256]byte
	for len(block) > 0 {
		n := min(len(block), len(buf)/4)
		for i, t := range block[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], t)
		}
		_, _ = d.Write(buf[:4*n])
		block = block[n:]
	}
	return d.Sum64()
}

// Append appends to dst the chained keys of every full block of tokens and
// returns the extended slice. A trailing partial block has no key: engines
// cache full blocks only.
func Append(dst []uint64, seed uint64, tokens []uint32, blockSize int) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	key := seed
	for len(tokens) >= blockSize {
		key = Next(key, tokens[:blockSize])
		dst = append(dst, key)
		tokens = tokens[blockSize:]
	}
	return dst
}

// Remix is splitmix64's finalizer: a second, independent-looking hash of a
// 64-bit key, for the structures that index keys (Bloom probes, hash-table
// slots). Keys may be engine hashes of any quality; remixed, their bits are
// uniform.
func Remix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// TierSalt is the constant that marks keys of blocks held on medium (an
// offload tier such as "CPU" or "DISK", upper case) and on no GPU: Tiered
// mixes it into a key. Salting keeps a sidecar's one filter for every tier,
// and makes a tier's key unrelated to the GPU key of the same block, so a
// router that knows no tiers never mistakes one for the other.
func TierSalt(medium string) uint64 {
	return xxhash.Sum64String("kvmesh-tier\x00" + medium)
}

// Tiered is the key under which a block of key key is published when it
// is resident only on the tier salt names (TierSalt).
func Tiered(key, salt uint64) uint64 { return Remix(key ^ salt) }
