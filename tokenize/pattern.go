package tokenize

import (
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// span is one piece of a split: bytes [start, end) of the split text, and
// whether the pattern matched it.
type span struct {
	start, end int
	match      bool
}

// pattern finds the successive non-overlapping matches of a split pattern.
type pattern interface {
	// spans returns s cut into matches and the gaps between them, in order,
	// as HF's Pattern::find_matches does.
	spans(s string, dst []span) ([]span, error)
}

// scanPattern is a pattern with a hand-written scanner: it matches at every
// position, so there are no gaps.
type scanPattern struct{ scan scanner }

func (p scanPattern) spans(s string, dst []span) ([]span, error) {
	for i := 0; i < len(s); {
		end := p.scan(s, i)
		dst = append(dst, span{i, end, true})
		i = end
	}
	return dst, nil
}

// regexTimeout bounds one regexp2 match so a pathological pattern cannot
// stall a request.
const regexTimeout = 5 * time.Second

// regexPattern is the general path: regexp2 runs the Oniguruma-style
// patterns of tokenizer.json (lookahead, \p{..}) as HF does.
type regexPattern struct{ re *regexp2.Regexp }

func compileRegex(src string) (*regexp2.Regexp, error) {
	re, err := regexp2.Compile(src, regexp2.None)
	if err != nil {
		return nil, fmt.Errorf("tokenize: regex %q: %w", src, err)
	}
	re.MatchTimeout = regexTimeout
	return re, nil
}

func (p regexPattern) spans(s string, dst []span) ([]span, error) {
	if s == "" {
		return dst, nil
	}
	runes := []rune(s)
	// byteAt[k] is the byte offset of rune k.
	byteAt := make([]int, len(runes)+1)
	off := 0
	for k, r := range runes {
		byteAt[k] = off
		off += utf8.RuneLen(r)
	}
	byteAt[len(runes)] = off
	prev := 0
	m, err := p.re.FindRunesMatch(runes)
	for ; m != nil && err == nil; m, err = p.re.FindNextMatch(m) {
		start, end := byteAt[m.Index], byteAt[m.Index+m.Length]
		if start == end {
			continue // empty matches split nothing
		}
		if prev != start {
			dst = append(dst, span{prev, start, false})
		}
		dst = append(dst, span{start, end, true})
		prev = end
	}
	if err != nil {
		return dst, fmt.Errorf("tokenize: split regex: %w", err)
	}
	if prev != len(s) {
		dst = append(dst, span{prev, len(s), false})
	}
	return dst, nil
}

// stringPattern matches a literal string.
type stringPattern struct{ lit string }

func (p stringPattern) spans(s string, dst []span) ([]span, error) {
	if p.lit == "" {
		return append(dst, span{0, len(s), false}), nil
	}
	prev := 0
	for {
		k := strings.Index(s[prev:], p.lit)
		if k < 0 {
			break
		}
		start := prev + k
		if start != prev {
			dst = append(dst, span{prev, start, false})
		}
		dst = append(dst, span{start, start + len(p.lit), true})
		prev = start + len(p.lit)
	}
	if prev != len(s) {
		dst = append(dst, span{prev, len(s), false})
	}
	return dst, nil
}

// funcPattern matches each single character for which match is true.
type funcPattern struct{ match func(rune) bool }

func (p funcPattern) spans(s string, dst []span) ([]span, error) {
	prev := 0
	for i, r := range s {
		if p.match(r) {
			if i != prev {
				dst = append(dst, span{prev, i, false})
			}
			end := i + utf8.RuneLen(r)
			dst = append(dst, span{i, end, true})
			prev = end
		}
	}
	if prev != len(s) {
		dst = append(dst, span{prev, len(s), false})
	}
	return dst, nil
}

// behavior is HF's SplitDelimiterBehavior.
type behavior uint8

const (
	behaviorRemoved behavior = iota
	behaviorIsolated
	behaviorMergedWithPrevious
	behaviorMergedWithNext
	behaviorContiguous
)

func parseBehavior(s string) (behavior, error) {
	switch s {
	case "Removed":
		return behaviorRemoved, nil
	case "Isolated":
		return behaviorIsolated, nil
	case "MergedWithPrevious":
		return behaviorMergedWithPrevious, nil
	case "MergedWithNext":
		return behaviorMergedWithNext, nil
	case "Contiguous":
		return behaviorContiguous, nil
	}
	return 0, &UnsupportedError{Component: "split behavior", Type: s}
}

// applyBehavior turns matches and gaps into the pieces HF keeps, exactly as
// NormalizedString::split does. The match flags of the result mean "keep".
func applyBehavior(in []span, b behavior, invert bool) []span {
	if invert {
		for k := range in {
			in[k].match = !in[k].match
		}
	}
	switch b {
	case behaviorIsolated:
		for k := range in {
			in[k].match = true
		}
		return in
	case behaviorRemoved:
		for k := range in {
			in[k].match = !in[k].match
		}
		return in
	case behaviorContiguous:
		out := in[:0]
		prevMatch := false
		for _, sp := range in {
			m := sp.match // read before out (aliasing in) overwrites it
			if m == prevMatch && len(out) > 0 {
				out[len(out)-1].end = sp.end
			} else {
				out = append(out, span{sp.start, sp.end, true})
			}
			prevMatch = m
		}
		return out
	case behaviorMergedWithPrevious:
		out := in[:0]
		prevMatch := false
		for _, sp := range in {
			m := sp.match
			if m && !prevMatch && len(out) > 0 {
				out[len(out)-1].end = sp.end
			} else {
				out = append(out, span{sp.start, sp.end, true})
			}
			prevMatch = m
		}
		return out
	case behaviorMergedWithNext:
		// Fold from the right, then restore the order.
		out := make([]span, 0, len(in))
		prevMatch := false
		for k := len(in) - 1; k >= 0; k-- {
			sp := in[k]
			if sp.match && !prevMatch && len(out) > 0 {
				out[len(out)-1].start = sp.start
			} else {
				out = append(out, span{sp.start, sp.end, true})
			}
			prevMatch = sp.match
		}
		for l, r := 0, len(out)-1; l < r; l, r = l+1, r-1 {
			out[l], out[r] = out[r], out[l]
		}
		return out
	}
	return in
}
