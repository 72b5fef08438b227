package kvevents

import (
	"encoding/binary"
	"fmt"
	"math"
)

// A hand-written msgpack reader and writer for the few shapes KV events use.
// Hand-parsing (rather than msgpack/v5's Decoder) lets the decoder borrow
// string bytes from the payload and fill reused slices, which is what makes
// the hot path allocation-free; BenchmarkDecodeBlockStored measures it.

// maxDepth bounds nesting when skipping unknown values, so hostile input
// cannot exhaust the stack.
const maxDepth = 64

// DecodeError reports malformed input: what was wrong, and where.
type DecodeError struct {
	Offset int    // byte offset in the payload where the problem was found
	Event  int    // index of the event being decoded; -1 at batch level
	Field  string // field being decoded, "" if none
	Reason string
}

func (e *DecodeError) Error() string {
	where := "batch"
	if e.Event >= 0 {
		where = fmt.Sprintf("event %d", e.Event)
	}
	if e.Field != "" {
		where += " field " + e.Field
	}
	return fmt.Sprintf("kvevents: decode %s at byte %d: %s", where, e.Offset, e.Reason)
}

// reader walks a msgpack payload. event and field only label errors.
type reader struct {
	buf   []byte
	off   int
	event int
	field string
}

func (r *reader) fail(format string, args ...any) error {
	return &DecodeError{Offset: r.off, Event: r.event, Field: r.field, Reason: fmt.Sprintf(format, args...)}
}

func (r *reader) remaining() int { return len(r.buf) - r.off }

// take returns the next n bytes without copying.
func (r *reader) take(n int) ([]byte, error) {
	if n < 0 || n > r.remaining() {
		return nil, r.fail("truncated: need %d bytes, have %d", n, r.remaining())
	}
	b := r.buf[r.off : r.off+n]
	r.off += n
	return b, nil
}

func (r *reader) byte1() (byte, error) {
	if r.off >= len(r.buf) {
		return 0, r.fail("truncated: unexpected end of payload")
	}
	c := r.buf[r.off]
	r.off++
	return c, nil
}

func (r *reader) uintN(n int) (uint64, error) {
	b, err := r.take(n)
	if err != nil {
		return 0, err
	}
	switch n {
	case 1:
		return uint64(b[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(b)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(b)), nil
	}
	return binary.BigEndian.Uint64(b), nil
}

// skipNil consumes a nil and reports whether there was one.
func (r *reader) skipNil() bool {
	if r.off < len(r.buf) && r.buf[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

// peekIsMap reports whether the next value is a map, without consuming it.
func (r *reader) peekIsMap() bool {
	if r.off >= len(r.buf) {
		return false
	}
	c := r.buf[r.off]
	return c&0xf0 == 0x80 || c == 0xde || c == 0xdf
}

// peekIsArray reports whether the next value is an array, without
// consuming it.
func (r *reader) peekIsArray() bool {
	if r.off >= len(r.buf) {
		return false
	}
	c := r.buf[r.off]
	return c&0xf0 == 0x90 || c == 0xdc || c == 0xdd
}

// container reads an array or map header. The length is checked against the
// bytes left (every element takes at least one byte), which bounds any
// allocation a hostile length could cause.
func (r *reader) container() (n int, isMap bool, err error) {
	start := r.off
	c, err := r.byte1()
	if err != nil {
		return 0, false, err
	}
	var u uint64
	switch {
	case c&0xf0 == 0x90:
		u = uint64(c & 0x0f)
	case c&0xf0 == 0x80:
		u, isMap = uint64(c&0x0f), true
	case c == 0xdc:
		u, err = r.uintN(2)
	case c == 0xdd:
		u, err = r.uintN(4)
	case c == 0xde:
		u, err = r.uintN(2)
		isMap = true
	case c == 0xdf:
		u, err = r.uintN(4)
		isMap = true
	default:
		r.off = start
		return 0, false, r.fail("want array or map, got %s", codeName(c))
	}
	if err != nil {
		return 0, false, err
	}
	per := uint64(1)
	if isMap {
		per = 2
	}
	if u > uint64(r.remaining())/per {
		r.off = start
		return 0, false, r.fail("length %d exceeds the %d bytes left", u, r.remaining())
	}
	return int(u), isMap, nil
}

// array reads an array header; nil reads as an empty array.
func (r *reader) array() (int, error) {
	if r.skipNil() {
		return 0, nil
	}
	start := r.off
	n, isMap, err := r.container()
	if err != nil {
		return 0, err
	}
	if isMap {
		r.off = start
		return 0, r.fail("want array, got map")
	}
	return n, nil
}

// str reads a string and returns its bytes, borrowed from the payload.
func (r *reader) str() ([]byte, error) {
	start := r.off
	c, err := r.byte1()
	if err != nil {
		return nil, err
	}
	var n uint64
	switch {
	case c&0xe0 == 0xa0:
		n = uint64(c & 0x1f)
	case c == 0xd9:
		n, err = r.uintN(1)
	case c == 0xda:
		n, err = r.uintN(2)
	case c == 0xdb:
		n, err = r.uintN(4)
	default:
		r.off = start
		return nil, r.fail("want string, got %s", codeName(c))
	}
	if err != nil {
		return nil, err
	}
	return r.take(int(n))
}

// integer reads any msgpack integer. It returns the value's 64 bits and
// whether it was a negative (signed) value; for those bits is two's complement.
func (r *reader) integer() (bits uint64, negative bool, err error) {
	start := r.off
	c, err := r.byte1()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c <= 0x7f:
		return uint64(c), false, nil
	case c >= 0xe0:
		return uint64(int64(int8(c))), true, nil
	}
	switch c {
	case 0xcc:
		bits, err = r.uintN(1)
	case 0xcd:
		bits, err = r.uintN(2)
	case 0xce:
		bits, err = r.uintN(4)
	case 0xcf:
		bits, err = r.uintN(8)
	case 0xd0:
		bits, err = r.uintN(1)
		bits = uint64(int64(int8(bits)))
	case 0xd1:
		bits, err = r.uintN(2)
		bits = uint64(int64(int16(bits)))
	case 0xd2:
		bits, err = r.uintN(4)
		bits = uint64(int64(int32(bits)))
	case 0xd3:
		bits, err = r.uintN(8)
	default:
		r.off = start
		return 0, false, r.fail("want integer, got %s", codeName(c))
	}
	return bits, c >= 0xd0 && int64(bits) < 0, err
}

// int64 reads an integer that must fit an int64.
func (r *reader) int64() (int64, error) {
	start := r.off
	bits, negative, err := r.integer()
	if err != nil {
		return 0, err
	}
	if !negative && bits > math.MaxInt64 {
		r.off = start
		return 0, r.fail("integer %d overflows int64", bits)
	}
	return int64(bits), nil
}

// int reads an integer that must fit a Go int; nil reads as 0.
func (r *reader) int() (int, error) {
	if r.skipNil() {
		return 0, nil
	}
	start := r.off
	v, err := r.int64()
	if err != nil {
		return 0, err
	}
	if int64(int(v)) != v {
		r.off = start
		return 0, r.fail("integer %d overflows int", v)
	}
	return int(v), nil
}

// uint32 reads a token id. The common encodings are decoded inline.
func (r *reader) uint32() (uint32, error) {
	if r.off < len(r.buf) {
		c := r.buf[r.off]
		switch {
		case c <= 0x7f:
			r.off++
			return uint32(c), nil
		case c == 0xcc && r.off+2 <= len(r.buf):
			v := r.buf[r.off+1]
			r.off += 2
			return uint32(v), nil
		case c == 0xcd && r.off+3 <= len(r.buf):
			v := binary.BigEndian.Uint16(r.buf[r.off+1:])
			r.off += 3
			return uint32(v), nil
		case c == 0xce && r.off+5 <= len(r.buf):
			v := binary.BigEndian.Uint32(r.buf[r.off+1:])
			r.off += 5
			return v, nil
		}
	}
	start := r.off
	bits, negative, err := r.integer()
	if err != nil {
		return 0, err
	}
	if negative || bits > math.MaxUint32 {
		r.off = start
		return 0, r.fail("token id %d out of uint32 range", int64(bits))
	}
	return uint32(bits), nil
}

// hash reads a block hash: an integer of any width (negative values are
// reinterpreted as two's complement) or bin, folded to its last 8 bytes read
// big-endian (left-padded with zeros when shorter) the way vLLM truncates a
// digest in int mode, so both modes give the same uint64.
func (r *reader) hash() (uint64, error) {
	if r.off < len(r.buf) {
		c := r.buf[r.off]
		if c == 0xcf && r.off+9 <= len(r.buf) {
			v := binary.BigEndian.Uint64(r.buf[r.off+1:])
			r.off += 9
			return v, nil
		}
		if c == 0xc4 || c == 0xc5 || c == 0xc6 {
			b, err := r.bin()
			if err != nil {
				return 0, err
			}
			if len(b) > 8 {
				b = b[len(b)-8:]
			}
			var v uint64
			for _, x := range b {
				v = v<<8 | uint64(x)
			}
			return v, nil
		}
	}
	bits, _, err := r.integer()
	return bits, err
}

func (r *reader) bin() ([]byte, error) {
	start := r.off
	c, err := r.byte1()
	if err != nil {
		return nil, err
	}
	var n uint64
	switch c {
	case 0xc4:
		n, err = r.uintN(1)
	case 0xc5:
		n, err = r.uintN(2)
	case 0xc6:
		n, err = r.uintN(4)
	default:
		r.off = start
		return nil, r.fail("want bin, got %s", codeName(c))
	}
	if err != nil {
		return nil, err
	}
	return r.take(int(n))
}

// float reads a float32/float64, or an integer as a float; nil reads as 0.
func (r *reader) float() (float64, error) {
	if r.skipNil() {
		return 0, nil
	}
	if r.off < len(r.buf) {
		switch r.buf[r.off] {
		case 0xcb:
			r.off++
			u, err := r.uintN(8)
			return math.Float64frombits(u), err
		case 0xca:
			r.off++
			u, err := r.uintN(4)
			return float64(math.Float32frombits(uint32(u))), err
		}
	}
	bits, negative, err := r.integer()
	if err != nil {
		return 0, err
	}
	if negative {
		return float64(int64(bits)), nil
	}
	return float64(bits), nil
}

// skip consumes one complete value of any type, checking it is well formed.
func (r *reader) skip(depth int) error {
	if depth > maxDepth {
		return r.fail("nesting deeper than %d", maxDepth)
	}
	start := r.off
	c, err := r.byte1()
	if err != nil {
		return err
	}
	switch {
	case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		return nil
	case c&0xe0 == 0xa0:
		_, err = r.take(int(c & 0x1f))
		return err
	case c&0xf0 == 0x90, c&0xf0 == 0x80, c == 0xdc, c == 0xdd, c == 0xde, c == 0xdf:
		r.off = start
		n, isMap, err := r.container()
		if err != nil {
			return err
		}
		if isMap {
			n *= 2
		}
		for i := 0; i < n; i++ {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	}
	var n uint64
	switch c {
	case 0xcc, 0xd0, 0xd4:
		n = 1
	case 0xcd, 0xd1, 0xd5:
		n = 2
	case 0xce, 0xd2, 0xca, 0xd6:
		n = 4
	case 0xcf, 0xd3, 0xcb, 0xd7:
		n = 8
	case 0xd8:
		n = 16
	case 0xc4, 0xd9:
		n, err = r.uintN(1)
	case 0xc5, 0xda:
		n, err = r.uintN(2)
	case 0xc6, 0xdb:
		n, err = r.uintN(4)
	case 0xc7:
		n, err = r.uintN(1)
		n++ // ext type byte
	case 0xc8:
		n, err = r.uintN(2)
		n++
	case 0xc9:
		n, err = r.uintN(4)
		n++
	default: // 0xc1 is never used
		r.off = start
		return r.fail("invalid msgpack code 0x%02x", c)
	}
	if c >= 0xd4 && c <= 0xd8 {
		n++ // fixext: type byte + data
	}
	if err != nil {
		return err
	}
	if n > uint64(r.remaining()) {
		return r.fail("truncated: need %d bytes, have %d", n, r.remaining())
	}
	r.off += int(n)
	return nil
}

func codeName(c byte) string {
	switch {
	case c <= 0x7f, c >= 0xe0, c >= 0xcc && c <= 0xd3:
		return "integer"
	case c&0xf0 == 0x80, c == 0xde, c == 0xdf:
		return "map"
	case c&0xf0 == 0x90, c == 0xdc, c == 0xdd:
		return "array"
	case c&0xe0 == 0xa0, c >= 0xd9 && c <= 0xdb:
		return "string"
	case c == 0xc0:
		return "nil"
	case c == 0xc2, c == 0xc3:
		return "bool"
	case c == 0xca, c == 0xcb:
		return "float"
	case c >= 0xc4 && c <= 0xc6:
		return "bin"
	case c >= 0xc7 && c <= 0xc9, c >= 0xd4 && c <= 0xd8:
		return "ext"
	}
	return fmt.Sprintf("invalid code 0x%02x", c)
}

// Writer side: msgspec picks the smallest encoding for every value, and so
// do these, so AppendBatch reproduces a Python producer's bytes.

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

func appendInt(b []byte, v int64) []byte {
	switch {
	case v >= 0:
		return appendUint(b, uint64(v))
	case v >= -32:
		return append(b, byte(int8(v)))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(int8(v)))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(int16(v)))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(int32(v)))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}

func appendFloat(b []byte, v float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(v))
}

func appendNil(b []byte) []byte { return append(b, 0xc0) }

func appendStr(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xdb), uint32(n))
	}
	return append(b, s...)
}

// appendStrOrNil writes "" as nil: Python's None for an absent optional str.
func appendStrOrNil(b []byte, s string) []byte {
	if s == "" {
		return appendNil(b)
	}
	return appendStr(b, s)
}

func appendArrayHeader(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

func appendMapHeader(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdf), uint32(n))
}
