package chatconv

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"unicode/utf16"
)

// appendPyJSON appends raw re-encoded as Python's json.dumps writes it with
// its defaults: ", " and ": " separators, keys in order, every non-ASCII
// character escaped. Numbers keep their spelling (Python would respell a
// float such as 1E2 as 100.0: the same value once parsed, which is all the
// template sees, since vLLM parses tool-call arguments before rendering).
func appendPyJSON(dst, raw []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	type frame struct {
		object bool
		n      int // values and keys written
	}
	var stack []frame
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			if len(stack) > 0 {
				return nil, errors.New("unexpected end of JSON")
			}
			return dst, nil
		}
		if err != nil {
			return nil, err
		}
		if d, ok := tok.(json.Delim); ok && (d == '}' || d == ']') {
			stack = stack[:len(stack)-1]
			dst = append(dst, byte(d))
			continue
		}
		if len(stack) > 0 {
			f := &stack[len(stack)-1]
			switch {
			case f.object && f.n%2 == 1:
				dst = append(dst, ": "...)
			case f.n > 0:
				dst = append(dst, ", "...)
			}
			f.n++
		}
		switch v := tok.(type) {
		case json.Delim:
			stack = append(stack, frame{object: v == '{'})
			dst = append(dst, byte(v))
		case string:
			dst = appendASCIIString(dst, v)
		case json.Number:
			dst = append(dst, v...)
		case bool:
			if v {
				dst = append(dst, "true"...)
			} else {
				dst = append(dst, "false"...)
			}
		case nil:
			dst = append(dst, "null"...)
		}
	}
}

// appendASCIIString is Python's json.dumps(s) with ensure_ascii: every
// character outside printable ASCII (DEL included) as a lowercase \uXXXX
// escape, surrogate pairs beyond the BMP.
func appendASCIIString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	esc := func(dst []byte, r rune) []byte {
		return append(dst, '\\', 'u', hex[r>>12&15], hex[r>>8&15], hex[r>>4&15], hex[r&15])
	}
	dst = append(dst, '"')
	for _, r := range s {
		switch {
		case r < 0x7f && shortEscapes[r] != 0:
			dst = append(dst, '\\', shortEscapes[r])
		case r < 0x20:
			dst = esc(dst, r)
		case r < 0x7f:
			dst = append(dst, byte(r))
		case r > 0xFFFF:
			hi, lo := utf16.EncodeRune(r)
			dst = esc(esc(dst, hi), lo)
		default:
			dst = esc(dst, r)
		}
	}
	return append(dst, '"')
}

// shortEscapes are the two-character escapes json.dumps writes.
var shortEscapes = [0x7f]byte{'"': '"', '\\': '\\', '\n': 'n', '\r': 'r', '\t': 't', '\b': 'b', '\f': 'f'}
