package bloom

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Snapshot is one generation of a sidecar's filter as of delta Seq.
type Snapshot struct {
	Epoch, Generation, Seq uint64
	M, K                   uint
	// Keys is the number of keys in the generation as of Seq.
	Keys  int
	Words []uint64
	// chain, from Share.DecodeSharedSnapshot, is the chain whose words
	// Words are.
	chain *chain
}

// Delta is the keys a sidecar added to generation Generation after delta
// Seq-1.
type Delta struct {
	Epoch, Generation, Seq uint64
	Keys                   []uint64
}

// Wire format, little-endian, version 1:
//
//	snapshot: 'K' 'B' version=1 kind=1 | k u8 | 3 zero bytes |
//	          epoch u64 | generation u64 | seq u64 | m u64 (bits) | keys u64 |
//	          m/64 words u64
//	delta:    'K' 'B' version=1 kind=2 |
//	          epoch u64 | generation u64 | seq u64 | count u32 | count keys u64
//
// Keys are uniform 64-bit hashes: a sorted varint-delta coding would save
// under 10 % at the batch sizes deltas carry (see TestDeltaKeysDoNotCompress),
// so they travel raw.
const (
	wireMagic0, wireMagic1 = 'K', 'B'
	wireVersion            = 1
	kindSnapshot           = 1
	kindDelta              = 2

	snapshotHeaderLen = 4 + 4 + 5*8
	deltaHeaderLen    = 4 + 3*8 + 4

	// maxM bounds a decoded filter (512 MiB of bits) so no arithmetic on
	// outside input can overflow.
	maxM = 1 << 32
)

// Decoding errors; the error returned wraps one of them.
var (
	ErrShort    = errors.New("bloom: message truncated")
	ErrMagic    = errors.New("bloom: not a kvmesh filter message")
	ErrVersion  = errors.New("bloom: unsupported message version")
	ErrKind     = errors.New("bloom: unexpected message kind")
	ErrGeometry = errors.New("bloom: invalid filter geometry")
	ErrLength   = errors.New("bloom: length does not match contents")
)

// SnapshotSize is the encoded size of a snapshot of an m-bit filter.
func SnapshotSize(m uint) int { return snapshotHeaderLen + int(m/64)*8 }

// MaxCapacity is the largest number of keys whose filter at fpRate (as
// NewFilter sizes it) encodes as a snapshot of at most maxBytes; 0 when not
// even one key's does.
func MaxCapacity(fpRate float64, maxBytes int) int {
	fits := func(c uint) bool {
		blocks, _ := Params(c, fpRate)
		return SnapshotSize(uint(blocks*blockBits)) <= maxBytes
	}
	if !fits(1) {
		return 0
	}
	lo, hi := uint(1), uint(2)
	for fits(hi) {
		lo, hi = hi, hi*2
	}
	for hi-lo > 1 { // fits(lo), !fits(hi)
		if mid := lo + (hi-lo)/2; fits(mid) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return int(lo)
}

// DeltaSize is the encoded size of a delta of n keys.
func DeltaSize(n int) int { return deltaHeaderLen + 8*n }

// AppendBinary appends the snapshot's encoding to dst.
func (s *Snapshot) AppendBinary(dst []byte) []byte {
	dst = append(dst, wireMagic0, wireMagic1, wireVersion, kindSnapshot, byte(s.K), 0, 0, 0)
	dst = binary.LittleEndian.AppendUint64(dst, s.Epoch)
	dst = binary.LittleEndian.AppendUint64(dst, s.Generation)
	dst = binary.LittleEndian.AppendUint64(dst, s.Seq)
	dst = binary.LittleEndian.AppendUint64(dst, uint64(s.M))
	dst = binary.LittleEndian.AppendUint64(dst, uint64(max(s.Keys, 0)))
	dst = growBytes(dst, 8*len(s.Words))
	for _, w := range s.Words {
		dst = binary.LittleEndian.AppendUint64(dst, w)
	}
	return dst
}

// DecodeSnapshot decodes a snapshot; the result owns fresh words and is a
// valid filter geometry (FromWords accepts it).
func DecodeSnapshot(b []byte) (Snapshot, error) {
	s, err := decodeSnapshotHeader(b)
	if err != nil {
		return s, err
	}
	body := b[snapshotHeaderLen:]
	s.Words = make([]uint64, s.M/64)
	for i := range s.Words {
		s.Words[i] = binary.LittleEndian.Uint64(body[8*i:])
	}
	return s, nil
}

// decodeSnapshotHeader decodes and checks all of a snapshot but its words.
func decodeSnapshotHeader(b []byte) (Snapshot, error) {
	if err := checkHeader(b, kindSnapshot, snapshotHeaderLen); err != nil {
		return Snapshot{}, err
	}
	k := uint(b[4])
	if b[5]|b[6]|b[7] != 0 {
		return Snapshot{}, fmt.Errorf("%w: reserved bytes set", ErrGeometry)
	}
	le := binary.LittleEndian
	s := Snapshot{
		K:          k,
		Epoch:      le.Uint64(b[8:]),
		Generation: le.Uint64(b[16:]),
		Seq:        le.Uint64(b[24:]),
	}
	m, keys := le.Uint64(b[32:]), le.Uint64(b[40:])
	if k == 0 || k > MaxK || m == 0 || m > maxM || m%blockBits != 0 {
		return Snapshot{}, fmt.Errorf("%w: m=%d k=%d", ErrGeometry, m, k)
	}
	if keys > maxM {
		return Snapshot{}, fmt.Errorf("%w: %d keys", ErrGeometry, keys)
	}
	body := b[snapshotHeaderLen:]
	if uint64(len(body)) != m/8 {
		return Snapshot{}, fmt.Errorf("%w: %d bytes of words for m=%d", ErrLength, len(body), m)
	}
	s.M, s.Keys = uint(m), int(keys)
	return s, nil
}

// AppendBinary appends the delta's encoding to dst.
func (d *Delta) AppendBinary(dst []byte) []byte {
	dst = append(dst, wireMagic0, wireMagic1, wireVersion, kindDelta)
	dst = binary.LittleEndian.AppendUint64(dst, d.Epoch)
	dst = binary.LittleEndian.AppendUint64(dst, d.Generation)
	dst = binary.LittleEndian.AppendUint64(dst, d.Seq)
	dst = binary.LittleEndian.AppendUint32(dst, uint32(len(d.Keys)))
	dst = growBytes(dst, 8*len(d.Keys))
	for _, k := range d.Keys {
		dst = binary.LittleEndian.AppendUint64(dst, k)
	}
	return dst
}

// DecodeDelta decodes a delta; the result owns fresh keys.
func DecodeDelta(b []byte) (Delta, error) {
	if err := checkHeader(b, kindDelta, deltaHeaderLen); err != nil {
		return Delta{}, err
	}
	le := binary.LittleEndian
	d := Delta{Epoch: le.Uint64(b[4:]), Generation: le.Uint64(b[12:]), Seq: le.Uint64(b[20:])}
	n := uint64(le.Uint32(b[28:]))
	body := b[deltaHeaderLen:]
	if uint64(len(body)) != 8*n {
		return Delta{}, fmt.Errorf("%w: %d bytes for %d keys", ErrLength, len(body), n)
	}
	d.Keys = make([]uint64, n)
	for i := range d.Keys {
		d.Keys[i] = le.Uint64(body[8*i:])
	}
	return d, nil
}

func checkHeader(b []byte, kind byte, headerLen int) error {
	if len(b) < 4 {
		return fmt.Errorf("%w: %d bytes", ErrShort, len(b))
	}
	if b[0] != wireMagic0 || b[1] != wireMagic1 {
		return ErrMagic
	}
	if b[2] != wireVersion {
		return fmt.Errorf("%w: %d", ErrVersion, b[2])
	}
	if b[3] != kind {
		return fmt.Errorf("%w: %d, want %d", ErrKind, b[3], kind)
	}
	if len(b) < headerLen {
		return fmt.Errorf("%w: %d bytes, header needs %d", ErrShort, len(b), headerLen)
	}
	return nil
}

// growBytes makes room for n more bytes in one allocation.
func growBytes(b []byte, n int) []byte {
	if cap(b)-len(b) < n {
		nb := make([]byte, len(b), len(b)+n)
		copy(nb, b)
		b = nb
	}
	return b
}
