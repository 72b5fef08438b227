// Package jsonscan reads the shape of JSON text without decoding it: where
// a string ends, and how deeply the text nests, so that a recursive decoder
// never sees more nesting than it can take. segmentio's decoder, used on
// request bodies for speed, recurses once per level with no limit: a 6 MB
// body of '[' overflowed the goroutine stack, a fatal error that no recover
// catches. encoding/json stops at 10,000 levels; checking the same limit
// first lets the fast decoders refuse exactly what encoding/json refuses.
package jsonscan

import "bytes"

// MaxDepth is encoding/json's nesting limit (its scanner's
// maxNestingDepth). Real requests nest a handful of levels.
const MaxDepth = 10000

// DepthWithin reports whether no array or object in b opens deeper than max
// levels. It only counts brackets outside strings: b's other syntax is left
// to the decoder, except that a closing bracket with nothing open (never
// valid JSON) also reports false, so the count cannot be run down by
// closers and built up again.
func DepthWithin(b []byte, max int) bool {
	// Nesting cannot exceed the number of opening brackets: counting them
	// (vectorised) spares almost every body the walk below.
	if bytes.Count(b, []byte{'['})+bytes.Count(b, []byte{'{'}) <= max {
		return true
	}
	depth := 0
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '"':
			i = StringEnd(b, i+1) - 1
		case '[', '{':
			if depth++; depth > max {
				return false
			}
		case ']', '}':
			if depth--; depth < 0 {
				return false
			}
		}
	}
	return true
}

// StringEnd returns the index just past the closing quote of the JSON
// string whose content starts at b[j], or len(b) when it is not closed. It jumps
// from quote to quote (IndexByte is vectorised) and counts the backslashes
// before each.
func StringEnd(b []byte, j int) int {
	for {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return len(b)
		}
		q := j + k
		n := 0
		for p := q - 1; p >= j && b[p] == '\\'; p-- {
			n++
		}
		if n%2 == 0 {
			return q + 1
		}
		j = q + 1
	}
}

// ValueEnd returns the index just past the JSON value starting at b[i] of a
// body already known to be valid JSON (len(b) for one not closed; i when i
// is past the end).
func ValueEnd(b []byte, i int) int {
	if i >= len(b) {
		return i
	}
	switch b[i] {
	case '"':
		return StringEnd(b, i+1)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				j = StringEnd(b, j+1) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
		return len(b)
	}
	j := i // a number, true, false or null
	for j < len(b) {
		switch b[j] {
		case ',', '}', ']', ' ', '\t', '\r', '\n':
			return j
		}
		j++
	}
	return j
}
