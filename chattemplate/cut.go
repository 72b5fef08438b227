package chattemplate

import (
	"unicode"
	"unicode/utf8"
)

// Rendering only the start of a long chat.
//
// The router needs the first max_prefix_tokens tokens of a prompt, and a
// chat of 64 MiB (one huge message, or millions of small ones) costs
// seconds to decode and render in full. A template that renders messages in
// order, each one's content in place after its header and before anything
// that depends on later messages, renders the leading messages of a chat as
// the same text the whole chat starts with, up to the end of the last
// content kept. CutMessages keeps the messages up to a byte budget, cuts the
// last content kept after a word and marks the cut with CutMarker; the
// caller renders that and keeps the prompt before the marker's last
// occurrence. Which templates render in order is known for the templates
// of natives (RendersInOrder) and for no other: a template may put a system
// message last, branch on loop.last or transform content (split off
// reasoning), and then a prefix of the messages renders differently.

// CutMarker ends the content of the last message CutMessages keeps. A
// template writes nothing of its own with NUL bytes in it, so its last
// occurrence in a rendered prompt is where the kept content ends.
const CutMarker = "\x00kvmesh-cut\x00"

// cutMarkerJSON is CutMarker inside a JSON string.
const cutMarkerJSON = `\u0000kvmesh-cut\u0000`

// RendersInOrder reports whether a prefix of a chat's messages renders as a
// prefix of the whole chat's prompt up to the end of the last content (see
// CutMessages): true for the templates of natives, whose source is known.
func (t *Template) RendersInOrder() bool { return t.native != nil }

// CutMessages returns a JSON array of the leading messages of the array raw
// (valid JSON) that fit in about budget bytes, the content of the last one
// cut after a word (a letter or digit followed by a space, or its own end
// if that is a letter or digit) and followed by CutMarker. kept is how many
// bytes of raw the cut keeps. It reads raw no further than budget bytes:
// what lies beyond costs nothing. ok is false when raw fits in the budget
// or when no content in it ends a word.
//
// A message cut before its end keeps only the keys before its content, and
// only if its role is one of them: what comes after the content (tool
// calls) renders after it. (A second role key after the content and past
// the budget, which a decoder would take instead, is not seen.)
func CutMessages(raw []byte, budget int) (cut []byte, kept int, ok bool) {
	if budget >= len(raw) || budget <= 0 {
		return nil, 0, false
	}
	w := cutWalker{raw: raw[:budget]}
	var last cutCandidate
	i := skipJSONSpace(w.raw, 0)
	if i >= len(w.raw) || w.raw[i] != '[' {
		return nil, 0, false
	}
	for i++; ; {
		i = skipJSONSpace(w.raw, i)
		if i >= len(w.raw) || w.raw[i] == ']' {
			break
		}
		c, end, complete := w.message(i)
		if c.at > 0 {
			last = c
		}
		if !complete {
			break
		}
		if i = skipJSONSpace(w.raw, end); i < len(w.raw) && w.raw[i] == ',' {
			i++
		}
	}
	if last.at == 0 {
		return nil, 0, false
	}
	out := make([]byte, 0, last.at+len(cutMarkerJSON)+len(last.rest)+3)
	out = append(out, raw[:last.at]...)
	out = append(out, cutMarkerJSON...)
	if last.rest != nil {
		out = append(out, last.rest...)
	} else {
		out = append(out, `"}`...)
	}
	return append(out, ']'), last.at, true
}

// cutCandidate is where a message's content may be cut: before raw[at].
// rest is what follows in the message from the content's closing quote,
// or nil when the message goes on past the budget ("}" closes it then).
type cutCandidate struct {
	at   int
	rest []byte
}

type cutWalker struct{ raw []byte }

// message walks the message starting at raw[i] and returns its candidate,
// where the message ends, and whether it ends within the budget. A message
// that is not an object, or holds content twice or as anything but a
// string, has no candidate.
func (w cutWalker) message(i int) (c cutCandidate, end int, complete bool) {
	raw := w.raw
	if raw[i] != '{' {
		end, complete = scanJSONValue(raw, i)
		return cutCandidate{}, end, complete
	}
	role, roleFirst, roleAfter, contents := false, false, false, 0
	at, closing := 0, 0
	// partial is the candidate when the budget ends inside the message:
	// only if its role came before its content, and not again after it.
	partial := func() (cutCandidate, int, bool) {
		if contents != 1 || at == 0 || !roleFirst || roleAfter {
			return cutCandidate{}, 0, false
		}
		return cutCandidate{at: at}, 0, false
	}
	for i++; ; {
		i = skipJSONSpace(raw, i)
		if i >= len(raw) {
			return partial()
		}
		switch raw[i] {
		case '}':
			if contents != 1 || at == 0 {
				return cutCandidate{}, i + 1, true
			}
			return cutCandidate{at: at, rest: raw[closing : i+1]}, i + 1, true
		case ',':
			i++
			continue
		}
		keyEnd, ok := scanJSONValue(raw, i)
		if !ok {
			return partial()
		}
		key := string(raw[i:keyEnd])
		if i = skipJSONSpace(raw, keyEnd); i >= len(raw) || raw[i] != ':' {
			return partial()
		}
		if i = skipJSONSpace(raw, i+1); i >= len(raw) {
			return partial()
		}
		switch key {
		case `"content"`:
			contents++
			if raw[i] != '"' {
				contents++ // not a string: no candidate
				break
			}
			roleFirst = role
			at, closing = wordEndInString(raw, i+1)
			if closing < 0 {
				return partial()
			}
			i = closing + 1
			continue
		case `"role"`:
			role, roleAfter = true, contents > 0
		}
		if i, ok = scanJSONValue(raw, i); !ok {
			return partial()
		}
	}
}

// wordEndInString scans the JSON string whose first byte is raw[i] and
// returns the offset of its last word end (0 if none) and of its closing
// quote (-1 if raw ends first). Characters written as escapes never end a
// word: only literal letters and digits do.
func wordEndInString(raw []byte, i int) (at, closing int) {
	wordChar := false // raw[i-1] is a literal letter or digit
	for i < len(raw) {
		c := raw[i]
		switch {
		case c == '"':
			if wordChar {
				at = i
			}
			return at, i
		case c == '\\':
			wordChar = false
			if i+1 < len(raw) && raw[i+1] == 'u' {
				i += 6
			} else {
				i += 2
			}
			continue
		case c == ' ':
			if wordChar {
				at = i
			}
			wordChar = false
		case c < utf8.RuneSelf:
			wordChar = 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
		default:
			r, size := utf8.DecodeRune(raw[i:])
			wordChar = unicode.IsLetter(r) || unicode.IsDigit(r)
			i += size
			continue
		}
		i++
	}
	return at, -1
}
