package tokenize

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode"

	"github.com/dlclark/regexp2"
	"golang.org/x/text/unicode/norm"
)

// UnsupportedError names a tokenizer.json component kvmesh cannot run
// exactly. Loading fails with it rather than tokenize silently wrong.
type UnsupportedError struct {
	Component string // "normalizer", "pre_tokenizer", "model", ...
	Type      string
}

func (e *UnsupportedError) Error() string {
	return fmt.Sprintf("tokenize: unsupported %s %q", e.Component, e.Type)
}

// ---- normalizers ----

type normalizer interface {
	normalize(s string) (string, error)
}

type unicodeForm struct{ f norm.Form }

func (n unicodeForm) normalize(s string) (string, error) {
	if isASCII(s) || n.f.IsNormalString(s) {
		return s, nil
	}
	return n.f.String(s), nil
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

type lowercase struct{}

func (lowercase) normalize(s string) (string, error) {
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range s {
		if r == 'İ' { // Rust's char::to_lowercase keeps the dot
			b.WriteString("i\u0307")
			continue
		}
		b.WriteRune(unicode.ToLower(r))
	}
	return b.String(), nil
}

type strip struct{ left, right bool }

func (n strip) normalize(s string) (string, error) {
	if n.left {
		s = strings.TrimLeftFunc(s, unicode.IsSpace)
	}
	if n.right {
		s = strings.TrimRightFunc(s, unicode.IsSpace)
	}
	return s, nil
}

type stripAccents struct{}

func (stripAccents) normalize(s string) (string, error) {
	return strings.Map(func(r rune) rune {
		if unicode.Is(unicode.Mn, r) {
			return -1
		}
		return r
	}, s), nil
}

type prepend struct{ text string }

func (n prepend) normalize(s string) (string, error) {
	if s == "" {
		return s, nil
	}
	return n.text + s, nil
}

type replaceString struct{ old, new string }

func (n replaceString) normalize(s string) (string, error) {
	return strings.ReplaceAll(s, n.old, n.new), nil
}

type replaceRegex struct {
	re      *regexp2.Regexp
	content string
}

func (n replaceRegex) normalize(s string) (string, error) {
	out, err := n.re.ReplaceFunc(s, func(regexp2.Match) string { return n.content }, -1, -1)
	if err != nil {
		return "", fmt.Errorf("tokenize: Replace normalizer: %w", err)
	}
	return out, nil
}

type normalizerSeq []normalizer

func (seq normalizerSeq) normalize(s string) (string, error) {
	var err error
	for _, n := range seq {
		if s, err = n.normalize(s); err != nil {
			return "", err
		}
	}
	return s, nil
}

// patternJSON is {"String": "..."} or {"Regex": "..."}.
type patternJSON struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

func parseNormalizer(raw json.RawMessage) (normalizer, error) {
	if isNull(raw) {
		return nil, nil
	}
	var n struct {
		Type        string            `json:"type"`
		Normalizers []json.RawMessage `json:"normalizers"`
		Prepend     string            `json:"prepend"`
		Pattern     patternJSON       `json:"pattern"`
		Content     string            `json:"content"`
		StripLeft   *bool             `json:"strip_left"`
		StripRight  *bool             `json:"strip_right"`
		Left        *bool             `json:"left"`
		Right       *bool             `json:"right"`
	}
	if err := json.Unmarshal(raw, &n); err != nil {
		return nil, fmt.Errorf("tokenize: normalizer: %w", err)
	}
	switch n.Type {
	case "NFC":
		return unicodeForm{norm.NFC}, nil
	case "NFD":
		return unicodeForm{norm.NFD}, nil
	case "NFKC":
		return unicodeForm{norm.NFKC}, nil
	case "NFKD":
		return unicodeForm{norm.NFKD}, nil
	case "Lowercase":
		return lowercase{}, nil
	case "StripAccents":
		return stripAccents{}, nil
	case "Strip":
		left, right := boolOr(n.StripLeft, boolOr(n.Left, true)), boolOr(n.StripRight, boolOr(n.Right, true))
		return strip{left, right}, nil
	case "Prepend":
		return prepend{n.Prepend}, nil
	case "Replace":
		switch {
		case n.Pattern.String != nil && *n.Pattern.String != "":
			return replaceString{*n.Pattern.String, n.Content}, nil
		case n.Pattern.Regex != nil:
			re, err := compileRegex(*n.Pattern.Regex)
			if err != nil {
				return nil, err
			}
			return replaceRegex{re, n.Content}, nil
		}
		return nil, &UnsupportedError{"normalizer", "Replace with an empty pattern"}
	case "Sequence":
		var seq normalizerSeq
		for _, r := range n.Normalizers {
			sub, err := parseNormalizer(r)
			if err != nil {
				return nil, err
			}
			if sub != nil {
				seq = append(seq, sub)
			}
		}
		return seq, nil
	}
	return nil, &UnsupportedError{"normalizer", n.Type}
}

func boolOr(p *bool, def bool) bool {
	if p == nil {
		return def
	}
	return *p
}

func isNull(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s == "" || s == "null"
}

// ---- pre-tokenizers ----

// preTokenizer is one stage of the (flattened) pre-tokenizer pipeline. It
// cuts s into pieces and hands each to e.emit(next, ...), stopping when
// emit reports the token budget is spent. first tells whether s starts at
// offset 0 of the input, which Metaspace's prepend_scheme "first" needs.
type preTokenizer interface {
	pretokenize(e *encoder, s string, first bool, next int) bool
}

type splitPre struct {
	pat      pattern
	scan     scanner // non-nil: a hand-written equivalent of pat
	behavior behavior
	invert   bool
	// known: pat is one of the patterns scannerFor knows (used or not),
	// whose pieces a cut at a word end leaves alone (wordCutSafe).
	known bool
}

func (p *splitPre) pretokenize(e *encoder, s string, first bool, next int) bool {
	if p.scan != nil && p.behavior == behaviorIsolated && !p.invert {
		for i := 0; i < len(s); {
			end := p.scan(s, i)
			if !e.emit(next, s[i:end], first && i == 0) {
				return false
			}
			i = end
		}
		return true
	}
	return e.emitSpans(next, s, first, p.pat, p.behavior, p.invert)
}

type byteLevelPre struct {
	addPrefixSpace bool
	useRegex       bool
	scan           scanner // gpt2 pattern; nil means use regexp2
	re             pattern
}

func (p *byteLevelPre) pretokenize(e *encoder, s string, first bool, next int) bool {
	if p.addPrefixSpace && !strings.HasPrefix(s, " ") {
		s = " " + s
	}
	if !p.useRegex {
		return e.emit(next, s, first)
	}
	if p.scan != nil {
		for i := 0; i < len(s); {
			end := p.scan(s, i)
			if !e.emit(next, s[i:end], first && i == 0) {
				return false
			}
			i = end
		}
		return true
	}
	return e.emitSpans(next, s, first, p.re, behaviorIsolated, false)
}

type prependScheme uint8

const (
	prependAlways prependScheme = iota
	prependFirst
	prependNever
)

type metaspacePre struct {
	replacement string
	scheme      prependScheme
	split       bool
}

func (p *metaspacePre) pretokenize(e *encoder, s string, first bool, next int) bool {
	s = strings.ReplaceAll(s, " ", p.replacement)
	if !strings.HasPrefix(s, p.replacement) &&
		(p.scheme == prependAlways || (p.scheme == prependFirst && first)) {
		s = p.replacement + s
	}
	if !p.split {
		return e.emit(next, s, first)
	}
	return e.emitSpans(next, s, first, stringPattern{p.replacement}, behaviorMergedWithNext, false)
}

type funcSplitPre struct {
	match    func(rune) bool
	behavior behavior
}

func (p *funcSplitPre) pretokenize(e *encoder, s string, first bool, next int) bool {
	return e.emitSpans(next, s, first, funcPattern{p.match}, p.behavior, false)
}

func isPunctuation(r rune) bool {
	return (r < 0x80 && unicode.IsPunct(r)) || (r < 0x80 && unicode.IsSymbol(r)) || unicode.IsPunct(r)
}

// parsePreTokenizer returns the flattened stages of a pre_tokenizer.
func parsePreTokenizer(raw json.RawMessage, regexOnly bool) ([]preTokenizer, error) {
	if isNull(raw) {
		return nil, nil
	}
	var p struct {
		Type             string            `json:"type"`
		PreTokenizers    []json.RawMessage `json:"pretokenizers"`
		Pattern          patternJSON       `json:"pattern"`
		Behavior         string            `json:"behavior"`
		Invert           bool              `json:"invert"`
		AddPrefixSpace   *bool             `json:"add_prefix_space"`
		UseRegex         *bool             `json:"use_regex"`
		Replacement      *string           `json:"replacement"`
		PrependScheme    *string           `json:"prepend_scheme"`
		Split            *bool             `json:"split"`
		IndividualDigits bool              `json:"individual_digits"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, fmt.Errorf("tokenize: pre_tokenizer: %w", err)
	}
	switch p.Type {
	case "Sequence":
		var stages []preTokenizer
		for _, r := range p.PreTokenizers {
			sub, err := parsePreTokenizer(r, regexOnly)
			if err != nil {
				return nil, err
			}
			stages = append(stages, sub...)
		}
		return stages, nil
	case "Split":
		b, err := parseBehavior(p.Behavior)
		if err != nil {
			return nil, err
		}
		sp := &splitPre{behavior: b, invert: p.Invert}
		switch {
		case p.Pattern.Regex != nil:
			re, err := compileRegex(*p.Pattern.Regex)
			if err != nil {
				return nil, err
			}
			sp.pat = regexPattern{re}
			sp.known = scannerFor(*p.Pattern.Regex) != nil
			if !regexOnly {
				sp.scan = scannerFor(*p.Pattern.Regex)
			}
		case p.Pattern.String != nil:
			sp.pat = stringPattern{*p.Pattern.String}
		default:
			return nil, &UnsupportedError{"pre_tokenizer", "Split without a pattern"}
		}
		return []preTokenizer{sp}, nil
	case "ByteLevel":
		bl := &byteLevelPre{addPrefixSpace: boolOr(p.AddPrefixSpace, true), useRegex: boolOr(p.UseRegex, true)}
		if bl.useRegex {
			re, err := compileRegex(gpt2Pattern)
			if err != nil {
				return nil, err
			}
			bl.re = regexPattern{re}
			if !regexOnly {
				bl.scan = scanGPT2
			}
		}
		return []preTokenizer{bl}, nil
	case "Metaspace":
		ms := &metaspacePre{replacement: "▁", scheme: prependAlways, split: boolOr(p.Split, true)}
		if p.Replacement != nil {
			ms.replacement = *p.Replacement
		}
		switch {
		case p.PrependScheme != nil:
			switch *p.PrependScheme {
			case "always":
				ms.scheme = prependAlways
			case "first":
				ms.scheme = prependFirst
			case "never":
				ms.scheme = prependNever
			default:
				return nil, &UnsupportedError{"Metaspace prepend_scheme", *p.PrependScheme}
			}
		case p.AddPrefixSpace != nil && !*p.AddPrefixSpace:
			ms.scheme = prependNever
		}
		if ms.replacement == "" {
			return nil, &UnsupportedError{"pre_tokenizer", "Metaspace with an empty replacement"}
		}
		return []preTokenizer{ms}, nil
	case "Digits":
		b := behaviorContiguous
		if p.IndividualDigits {
			b = behaviorIsolated
		}
		return []preTokenizer{&funcSplitPre{unicode.IsNumber, b}}, nil
	case "WhitespaceSplit":
		return []preTokenizer{&funcSplitPre{unicode.IsSpace, behaviorRemoved}}, nil
	case "Punctuation":
		b := behaviorIsolated
		if p.Behavior != "" {
			var err error
			if b, err = parseBehavior(p.Behavior); err != nil {
				return nil, err
			}
		}
		return []preTokenizer{&funcSplitPre{isPunctuation, b}}, nil
	}
	return nil, &UnsupportedError{"pre_tokenizer", p.Type}
}
