package tokenize

import (
	"unicode"
	"unicode/utf8"
)

// Hand-written scanners for the three split patterns that matter. Each one
// returns where the pattern's leftmost-first match starting at i ends; these
// patterns match at every position of a non-empty remainder, so a scanner
// never reports "no match". FuzzScannerMatchesRegexp checks every scanner
// against regexp2 running the pattern string itself.

// Split patterns recognised by their exact source text.
const (
	gpt2Pattern   = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	qwen2Pattern  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// Character classes as the patterns see them: \p{L}, \p{N}, \s (regexp2's
// \s is unicode.IsSpace) and everything else.
const (
	clsOther uint8 = iota
	clsLetter
	clsNumber
	clsSpace
)

var asciiClass = func() (t [utf8.RuneSelf]uint8) {
	for c := 0; c < utf8.RuneSelf; c++ {
		t[c] = runeClass(rune(c))
	}
	return t
}()

func runeClass(r rune) uint8 {
	switch {
	case unicode.IsLetter(r):
		return clsLetter
	case unicode.IsNumber(r):
		return clsNumber
	case unicode.IsSpace(r):
		return clsSpace
	}
	return clsOther
}

// classAt returns the class and byte size of the character at s[i].
func classAt(s string, i int) (uint8, int) {
	if c := s[i]; c < utf8.RuneSelf {
		return asciiClass[c], 1
	}
	r, size := utf8.DecodeRuneInString(s[i:])
	return runeClass(r), size
}

// runOf returns the end of the run of class cls starting at i.
func runOf(s string, i int, cls uint8) int {
	for i < len(s) {
		if b := s[i]; b < utf8.RuneSelf {
			if asciiClass[b] != cls {
				break
			}
			i++
			continue
		}
		c, size := classAt(s, i)
		if c != cls {
			break
		}
		i += size
	}
	return i
}

// contraction returns the length of 's 't 're 've 'm 'll 'd at s[i:] (s[i]
// is a quote), or 0. foldCase accepts ASCII upper case too, which is all
// regexp2's (?i) adds for these letters.
func contraction(s string, i int, foldCase bool) int {
	if i+1 >= len(s) {
		return 0
	}
	lower := func(c byte) byte {
		if foldCase && 'A' <= c && c <= 'Z' {
			return c + ('a' - 'A')
		}
		return c
	}
	switch lower(s[i+1]) {
	case 's', 't', 'm', 'd':
		return 2
	case 'r', 'v':
		if i+2 < len(s) && lower(s[i+2]) == 'e' {
			return 3
		}
	case 'l':
		if i+2 < len(s) && lower(s[i+2]) == 'l' {
			return 3
		}
	}
	return 0
}

// spaceTail handles `\s+(?!\S)|\s+` at i (a whitespace character): the
// whole run if it ends the text or is one character long, else the run
// minus its last character, which then leads the next piece.
func spaceTail(s string, i int) int {
	end, last := i, i
	for end < len(s) {
		c, size := classAt(s, end)
		if c != clsSpace {
			break
		}
		last = end
		end += size
	}
	if end == len(s) || last == i {
		return end
	}
	return last
}

// scanGPT2 matches gpt2Pattern at s[i:].
func scanGPT2(s string, i int) int {
	if s[i] == '\'' {
		if n := contraction(s, i, false); n > 0 {
			return i + n
		}
	}
	j := i
	if s[i] == ' ' {
		j++
	}
	if j < len(s) {
		if cls, size := classAt(s, j); cls != clsSpace {
			return runOf(s, j+size, cls)
		}
	}
	return spaceTail(s, i)
}

// scanLlama3 matches llama3Pattern (maxDigits 3) or qwen2Pattern (1) at s[i:].
func scanLlama3(s string, i int, maxDigits int) int {
	c := s[i]
	if c == '\'' {
		if n := contraction(s, i, true); n > 0 {
			return i + n
		}
	}
	cls, size := classAt(s, i)
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if cls == clsLetter {
		return runOf(s, i+size, clsLetter)
	}
	if cls != clsNumber && c != '\r' && c != '\n' && i+size < len(s) {
		if next, nsize := classAt(s, i+size); next == clsLetter {
			return runOf(s, i+size+nsize, clsLetter)
		}
	}
	// \p{N}{1,maxDigits}
	if cls == clsNumber {
		end := i + size
		for n := 1; n < maxDigits && end < len(s); n++ {
			c, size := classAt(s, end)
			if c != clsNumber {
				break
			}
			end += size
		}
		return end
	}
	// ` ?[^\s\p{L}\p{N}]+[\r\n]*`
	j := i
	if c == ' ' {
		j++
	}
	if j < len(s) {
		if other, _ := classAt(s, j); other == clsOther {
			end := runOf(s, j, clsOther)
			for end < len(s) && (s[end] == '\r' || s[end] == '\n') {
				end++
			}
			return end
		}
	}
	// `\s*[\r\n]+`: the run up to and including its last line break.
	lastBreak := -1
	for k := i; k < len(s); {
		c, size := classAt(s, k)
		if c != clsSpace {
			break
		}
		if s[k] == '\r' || s[k] == '\n' {
			lastBreak = k
		}
		k += size
	}
	if lastBreak >= 0 {
		return lastBreak + 1
	}
	return spaceTail(s, i)
}

// scanner is a split pattern with a hand-written matcher.
type scanner func(s string, i int) int

func scanLlama3Pattern(s string, i int) int { return scanLlama3(s, i, 3) }
func scanQwen2Pattern(s string, i int) int  { return scanLlama3(s, i, 1) }

// scannerFor returns the hand-written scanner for an exact pattern source.
func scannerFor(pattern string) scanner {
	switch pattern {
	case gpt2Pattern:
		return scanGPT2
	case llama3Pattern:
		return scanLlama3Pattern
	case qwen2Pattern:
		return scanQwen2Pattern
	}
	return nil
}
