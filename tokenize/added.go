package tokenize

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// addedToken is an entry of tokenizer.json's added_tokens.
type addedToken struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	Lstrip     bool   `json:"lstrip"`
	Rstrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// addedSpan is a piece of text cut by added tokens: tok is the index of the
// token it is, or -1 for plain text between tokens.
type addedSpan struct {
	start, end int
	tok        int32
}

// addedMatcher finds added tokens leftmost-longest, as the Aho-Corasick
// automaton of tokenizers' AddedVocabulary does, with a byte trie.
type addedMatcher struct {
	tokens []addedToken
	nodes  []trieNode
	first  [256]bool
	// firstByte is set when all tokens start with the same byte, so the
	// scan can use strings.IndexByte.
	firstByte  byte
	sameFirst  bool
	anyLRWords bool
}

// trieNode keeps its edges as a byte-sorted slice: a chat prompt walks the
// trie at every special token it holds, and a map lookup per byte (hashing
// included) was most of the split time.
type trieNode struct {
	labels  []byte  // sorted
	targets []int32 // targets[i] is the child reached by labels[i]
	tok     int32
}

// child returns the node reached from n by c, or -1.
func (n *trieNode) child(c byte) int32 {
	if len(n.labels) <= 8 {
		for i, l := range n.labels {
			if l == c {
				return n.targets[i]
			}
		}
		return -1
	}
	lo, hi := 0, len(n.labels)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if n.labels[m] < c {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo < len(n.labels) && n.labels[lo] == c {
		return n.targets[lo]
	}
	return -1
}

// addChild links a new child of n by c (absent before) to target.
func (n *trieNode) addChild(c byte, target int32) {
	i := 0
	for i < len(n.labels) && n.labels[i] < c {
		i++
	}
	n.labels = append(n.labels, 0)
	n.targets = append(n.targets, 0)
	copy(n.labels[i+1:], n.labels[i:])
	copy(n.targets[i+1:], n.targets[i:])
	n.labels[i], n.targets[i] = c, target
}

func newAddedMatcher(tokens []addedToken) *addedMatcher {
	a := &addedMatcher{nodes: []trieNode{{tok: -1}}}
	for _, t := range tokens {
		if t.Content == "" {
			continue
		}
		n := int32(0)
		for k := 0; k < len(t.Content); k++ {
			c := t.Content[k]
			next := a.nodes[n].child(c)
			if next < 0 {
				next = int32(len(a.nodes))
				a.nodes[n].addChild(c, next)
				a.nodes = append(a.nodes, trieNode{tok: -1})
			}
			n = next
		}
		if a.nodes[n].tok < 0 { // the first of duplicate contents wins
			a.nodes[n].tok = int32(len(a.tokens))
			a.tokens = append(a.tokens, t)
		}
		a.first[t.Content[0]] = true
	}
	if len(a.tokens) == 0 {
		return nil
	}
	distinct := 0
	for b, ok := range a.first {
		if ok {
			distinct++
			a.firstByte = byte(b)
		}
	}
	a.sameFirst = distinct == 1
	return a
}

// longest returns the end of the longest token starting at s[p:] and its
// index, or -1.
func (a *addedMatcher) longest(s string, p int) (int, int32) {
	n, end, tok := int32(0), -1, int32(-1)
	for k := p; k < len(s); k++ {
		next := a.nodes[n].child(s[k])
		if next < 0 {
			break
		}
		n = next
		if t := a.nodes[n].tok; t >= 0 {
			end, tok = k+1, t
		}
	}
	return end, tok
}

// next finds the leftmost-longest token at or after pos.
func (a *addedMatcher) next(s string, pos int) (start, end int, tok int32) {
	for p := pos; p < len(s); p++ {
		if a.sameFirst {
			k := strings.IndexByte(s[p:], a.firstByte)
			if k < 0 {
				return -1, -1, -1
			}
			p += k
		} else if !a.first[s[p]] {
			continue
		}
		if end, tok := a.longest(s, p); tok >= 0 {
			return p, end, tok
		}
	}
	return -1, -1, -1
}

// split cuts s into added tokens and the text between them, honouring
// single_word, lstrip and rstrip as AddedVocabulary::find_matches does.
func (a *addedMatcher) split(s string, dst []addedSpan) []addedSpan {
	startOffset := 0
	for pos := 0; pos < len(s); {
		start, end, tok := a.next(s, pos)
		if tok < 0 {
			break
		}
		pos = end
		t := &a.tokens[tok]
		if t.SingleWord {
			startSpace := start == 0 || !endsWithWord(s[:start])
			stopSpace := end == len(s) || !startsWithWord(s[end:])
			if !startSpace || !stopSpace {
				continue
			}
		}
		if t.Lstrip {
			start = max(len(strings.TrimRightFunc(s[:start], unicode.IsSpace)), startOffset)
		}
		if t.Rstrip {
			end = len(s) - len(strings.TrimLeftFunc(s[end:], unicode.IsSpace))
			pos = end // a token inside the stripped spaces would overlap
		}
		start = max(start, startOffset)
		if startOffset < start {
			dst = append(dst, addedSpan{startOffset, start, -1})
		}
		dst = append(dst, addedSpan{start, end, tok})
		startOffset = end
	}
	if startOffset < len(s) {
		dst = append(dst, addedSpan{startOffset, len(s), -1})
	}
	return dst
}

// isWordRune approximates Rust regex's Unicode \w.
func isWordRune(r rune) bool {
	return unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.Is(unicode.Mark, r) ||
		unicode.Is(unicode.Pc, r) || unicode.Is(unicode.Nl, r)
}

func endsWithWord(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return s != "" && isWordRune(r)
}

func startsWithWord(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return s != "" && isWordRune(r)
}
