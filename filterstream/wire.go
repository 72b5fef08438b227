package filterstream

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// errShort is returned when a message ends before a field does.
var errShort = errors.New("filterstream: message truncated")

// writer appends fields; it never fails.
type writer struct{ b []byte }

func (w *writer) byte(v byte)      { w.b = append(w.b, v) }
func (w *writer) uvarint(v uint64) { w.b = binary.AppendUvarint(w.b, v) }
func (w *writer) u64(v uint64)     { w.b = binary.LittleEndian.AppendUint64(w.b, v) }
func (w *writer) f32(v float32)    { w.b = binary.LittleEndian.AppendUint32(w.b, math.Float32bits(v)) }
func (w *writer) str(v string)     { w.uvarint(uint64(len(v))); w.b = append(w.b, v...) }

// reader consumes fields; the first error sticks and later reads return zero
// values, so a decoder checks err once at the end.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(err error) {
	if r.err == nil {
		r.err = err
	}
	r.b = nil
}

func (r *reader) byte() byte {
	if len(r.b) < 1 {
		r.fail(errShort)
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *reader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail(errShort)
		return 0
	}
	r.b = r.b[n:]
	return v
}

// int reads a uvarint that must fit an int no larger than max.
func (r *reader) int(max int) int {
	v := r.uvarint()
	if v > uint64(max) {
		r.fail(fmt.Errorf("filterstream: value %d over limit %d", v, max))
		return 0
	}
	return int(v)
}

func (r *reader) u64() uint64 {
	if len(r.b) < 8 {
		r.fail(errShort)
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *reader) f32() float32 {
	if len(r.b) < 4 {
		r.fail(errShort)
		return 0
	}
	v := math.Float32frombits(binary.LittleEndian.Uint32(r.b))
	r.b = r.b[4:]
	return v
}

// bytes returns a length-prefixed field of at most max bytes, aliasing the input.
func (r *reader) bytes(max int) []byte {
	n := r.int(max)
	if r.err != nil {
		return nil
	}
	if len(r.b) < n {
		r.fail(errShort)
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) str(max int) string { return string(r.bytes(max)) }

// rest returns what is left, aliasing the input.
func (r *reader) rest() []byte {
	v := r.b
	r.b = nil
	return v
}
