package residentset

import (
	"encoding/binary"

	"github.com/kvmesh/kvmesh/kvevents"
)

// extraKeys reads vLLM's per-block extra_keys (the tuple the engine mixed
// into each block's hash: LoRA name, multimodal items, cache salt for the
// block at token 0, prompt-embedding digests). kvmesh keys cover the LoRA
// adapter and the cache salt through the seed; anything else (an image, an
// embedding) makes the block's content more than its tokens, so it and the
// blocks after it cannot be keyed: the router, which keys text tokens only,
// must never find them.
//
// It returns the cache salt found in a root event's first block ("" if
// none) and how many leading blocks can be keyed. The msgpack is read in
// place by a small bounded reader: a declared length never allocates, and
// anything unexpected stops keying at that block.
func extraKeys(ev *kvevents.Event) (salt string, keyable int) {
	n := len(ev.BlockHashes)
	r := mpReader{b: ev.ExtraKeys}
	if len(r.b) == 0 {
		return "", n
	}
	entries, ok := r.arrayLen()
	if !ok {
		return "", 0 // unreadable: key nothing rather than guess
	}
	for i := range min(n, entries) {
		if r.isNil() {
			continue
		}
		items, ok := r.arrayLen()
		if !ok {
			return salt, i
		}
		for range items {
			str, num, kind := r.scalar()
			switch {
			case kind == mpStr && string(str) == ev.LoRAName && len(str) > 0:
			case kind == mpStr && i == 0 && !ev.HasParent && salt == "":
				salt = string(str) // cache_salt rides on the block at token 0
			case kind == mpInt && ev.LoRAID != 0 && num == ev.LoRAID: // older vLLM: lora_int_id
			default:
				return salt, i
			}
		}
	}
	return salt, n
}

// mpReader reads just the msgpack extra_keys use: arrays, nil, strings and
// integers. Every length is checked against the bytes left.
type mpReader struct {
	b   []byte
	off int
}

const (
	mpOther = iota
	mpStr
	mpInt
)

// need returns the next n bytes, or false when fewer are left.
func (r *mpReader) need(n int) ([]byte, bool) {
	if n < 0 || len(r.b)-r.off < n {
		return nil, false
	}
	b := r.b[r.off : r.off+n]
	r.off += n
	return b, true
}

func (r *mpReader) isNil() bool {
	if r.off < len(r.b) && r.b[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

// arrayLen reads an array header; a length longer than the bytes left (each
// element takes at least one) is malformed.
func (r *mpReader) arrayLen() (int, bool) {
	h, ok := r.need(1)
	if !ok {
		return 0, false
	}
	var n int
	switch c := h[0]; {
	case c >= 0x90 && c <= 0x9f:
		n = int(c & 0x0f)
	case c == 0xdc:
		b, ok := r.need(2)
		if !ok {
			return 0, false
		}
		n = int(binary.BigEndian.Uint16(b))
	case c == 0xdd:
		b, ok := r.need(4)
		if !ok {
			return 0, false
		}
		n = int(binary.BigEndian.Uint32(b))
	default:
		return 0, false
	}
	if n > len(r.b)-r.off {
		return 0, false
	}
	return n, true
}

// scalar reads a string or an integer; kind is mpOther for anything else
// (or malformed input), after which the reader must not be used.
func (r *mpReader) scalar() (str []byte, num int64, kind int) {
	h, ok := r.need(1)
	if !ok {
		return nil, 0, mpOther
	}
	c := h[0]
	strLen := -1
	switch {
	case c <= 0x7f:
		return nil, int64(c), mpInt
	case c >= 0xe0:
		return nil, int64(int8(c)), mpInt
	case c >= 0xa0 && c <= 0xbf:
		strLen = int(c & 0x1f)
	case c == 0xd9 || c == 0xda || c == 0xdb:
		w := 1 << (c - 0xd9) // 1, 2 or 4 length bytes
		b, ok := r.need(w)
		if !ok {
			return nil, 0, mpOther
		}
		strLen = int(uintBE(b))
	case c >= 0xcc && c <= 0xcf: // uint 8..64
		b, ok := r.need(1 << (c - 0xcc))
		if !ok {
			return nil, 0, mpOther
		}
		u := uintBE(b)
		if u > 1<<63-1 {
			return nil, 0, mpOther
		}
		return nil, int64(u), mpInt
	case c >= 0xd0 && c <= 0xd3: // int 8..64
		w := 1 << (c - 0xd0)
		b, ok := r.need(w)
		if !ok {
			return nil, 0, mpOther
		}
		u := uintBE(b)
		shift := 64 - 8*uint(w)
		return nil, int64(u<<shift) >> shift, mpInt
	default:
		return nil, 0, mpOther
	}
	b, ok := r.need(strLen)
	if !ok {
		return nil, 0, mpOther
	}
	return b, 0, mpStr
}

func uintBE(b []byte) uint64 {
	var u uint64
	for _, x := range b {
		u = u<<8 | uint64(x)
	}
	return u
}
