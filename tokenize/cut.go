package tokenize

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// Cutting a prompt at a word end.
//
// Routing needs a prompt's first max_prefix_tokens ids exactly and its
// total count roughly (the cost model's prefill work), but tokenizing the
// whole of a 64 MiB prompt to get them costs a second and hundreds of MB.
// The ids of text[:p] are the leading ids of text when p is a word end: a
// letter or digit followed by a space. For the tokenizers HF runs with a
// known pre-tokenizer (the GPT-2, Llama-3 and Qwen2 split patterns, or
// SentencePiece-style "▁" pieces) the piece holding that letter ends at the
// space whatever follows it, every earlier piece was decided by text before
// it, no normalizer supported here composes across a space, and no added
// token holds a word end (wordCutSafe checks all this at load). So only a
// window of the prompt is tokenized: its count is exact when the whole
// prompt fits, and extrapolated from the window's ids per byte beyond that.

// wordEnd returns the largest p in (limit/2, limit] at which text may be
// cut (text[p] is a space after a letter or digit), or 0 if there is none.
func wordEnd(text string, limit int) int {
	limit = min(limit, len(text)-1)
	for p := limit; p > limit/2; p-- {
		if text[p] != ' ' {
			continue
		}
		if r, _ := utf8.DecodeLastRuneInString(text[:p]); isWordEnd(r) {
			return p
		}
	}
	return 0
}

// isWordEnd reports whether r may end a word: in \p{L} or \p{Nd}, so in a
// word for the split patterns and for Builtin alike.
func isWordEnd(r rune) bool {
	if r < utf8.RuneSelf {
		return 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9'
	}
	return unicode.IsLetter(r) || unicode.IsDigit(r)
}

// holdsWordEnd reports whether s holds a word end (a letter or digit
// followed by a space), which would let a match straddle a cut.
func holdsWordEnd(s string) bool {
	for i := 1; i < len(s); i++ {
		if s[i] == ' ' {
			if r, _ := utf8.DecodeLastRuneInString(s[:i]); isWordEnd(r) {
				return true
			}
		}
	}
	return false
}

// wordCutSafe reports whether the ids of a text cut at a word end are the
// leading ids of the whole text for this tokenizer (see the top of the
// file).
func (t *HF) wordCutSafe() bool {
	for _, m := range []*addedMatcher{t.added, t.addedNorm} {
		if m == nil {
			continue
		}
		for _, a := range m.tokens {
			if holdsWordEnd(a.Content) {
				return false
			}
		}
	}
	spaceBecomesMeta, ok := localNormalizer(t.normalize)
	if !ok {
		return false
	}
	split := false
	for _, p := range t.pre {
		switch p := p.(type) {
		case *splitPre:
			if !p.known || p.behavior != behaviorIsolated || p.invert {
				return false
			}
			split = true
		case *byteLevelPre:
			split = split || p.useRegex // the GPT-2 pattern
		case *metaspacePre:
			if p.replacement == metaspace {
				spaceBecomesMeta = true
			}
			split = split || p.split
		case *funcSplitPre:
			// Digits, whitespace and punctuation splits cut at a space or
			// inside runs that end before it.
		default:
			return false
		}
	}
	// Without a splitting stage BPE sees whole segments: a cut before "▁"
	// is exact where no token holds "▁" after another character.
	return split || (spaceBecomesMeta && t.model.splitMeta)
}

// localNormalizer reports whether n changes text only within what lies
// between spaces (so never across a word end), and whether it turns a
// space into "▁".
func localNormalizer(n normalizer) (spaceBecomesMeta, ok bool) {
	switch n := n.(type) {
	case nil, unicodeForm, lowercase, strip, stripAccents, prepend:
		return false, true
	case replaceString:
		if n.old == " " {
			return n.new == metaspace, true
		}
		// A space written where there was none could join words.
		return false, !holdsWordEnd(n.old) && !strings.ContainsAny(n.new, " \t\n\r")
	case normalizerSeq:
		for _, sub := range n {
			meta, ok := localNormalizer(sub)
			if !ok {
				return false, false
			}
			spaceBecomesMeta = spaceBecomesMeta || meta
		}
		return spaceBecomesMeta, true
	}
	return false, false
}
