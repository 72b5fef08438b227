package chattemplate

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"
)

// maxJSONDepth bounds nesting so hostile input cannot exhaust the stack.
// encoding/json uses 10000; real chat requests nest a handful of levels.
const maxJSONDepth = 1000

// decodeJSON parses one JSON document into jinja values, keeping object keys
// in document order (jinja's Dict is ordered; FromGoValue would sort them),
// integers as ints and numbers with '.', 'e' or 'E' as floats — the way
// Python's json.loads does, so tojson later prints them back unchanged.
//
// It is a small hand-written parser rather than json.Decoder.Token because a
// 32k-token chat is ~130 KB of JSON decoded on every request, and Token
// allocates an interface per token. Strings that need no unescaping are
// substrings of src, so src must not be mutated afterwards (callers pass a
// fresh string copy of the request bytes).
func decodeJSON(src string) (jinja.Value, error) {
	return decodeJSONAt(src, 0)
}

// decodeJSONAt decodes a value found at nesting depth (so an array element
// decoded alone hits the same depth limit as inside its array).
func decodeJSONAt(src string, depth int) (jinja.Value, error) {
	p := jsonParser{src: src}
	p.skipSpace()
	v, err := p.value(depth)
	if err != nil {
		return jinja.Undefined(), err
	}
	p.skipSpace()
	if p.pos != len(p.src) {
		return jinja.Undefined(), p.errorf("unexpected %s after JSON value", p.describe())
	}
	return v, nil
}

// plainASCII marks bytes a JSON string can hold as they are: printable
// ASCII other than '"' and '\\'.
var plainASCII = func() (t [256]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

type jsonParser struct {
	src string
	pos int
}

func (p *jsonParser) errorf(format string, args ...any) error {
	return fmt.Errorf("invalid JSON at offset %d: %s", p.pos, fmt.Sprintf(format, args...))
}

func (p *jsonParser) describe() string {
	if p.pos >= len(p.src) {
		return "end of input"
	}
	r, _ := utf8.DecodeRuneInString(p.src[p.pos:])
	return strconv.QuoteRune(r)
}

func (p *jsonParser) skipSpace() {
	for p.pos < len(p.src) {
		switch p.src[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *jsonParser) value(depth int) (jinja.Value, error) {
	if depth > maxJSONDepth {
		return jinja.Undefined(), p.errorf("nesting deeper than %d", maxJSONDepth)
	}
	if p.pos >= len(p.src) {
		return jinja.Undefined(), p.errorf("unexpected end of input")
	}
	switch c := p.src[p.pos]; {
	case c == '{':
		return p.object(depth)
	case c == '[':
		return p.array(depth)
	case c == '"':
		s, err := p.str()
		if err != nil {
			return jinja.Undefined(), err
		}
		return jinja.NewString(s), nil
	case c == '-' || (c >= '0' && c <= '9'):
		return p.number()
	case strings.HasPrefix(p.src[p.pos:], "true"):
		p.pos += 4
		return jinja.NewBool(true), nil
	case strings.HasPrefix(p.src[p.pos:], "false"):
		p.pos += 5
		return jinja.NewBool(false), nil
	case strings.HasPrefix(p.src[p.pos:], "null"):
		p.pos += 4
		return jinja.None(), nil
	}
	return jinja.Undefined(), p.errorf("unexpected %s", p.describe())
}

func (p *jsonParser) object(depth int) (jinja.Value, error) {
	p.pos++ // '{'
	d := jinja.NewDict()
	dict := d.AsDict()
	p.skipSpace()
	if p.pos < len(p.src) && p.src[p.pos] == '}' {
		p.pos++
		return d, nil
	}
	for {
		p.skipSpace()
		if p.pos >= len(p.src) || p.src[p.pos] != '"' {
			return jinja.Undefined(), p.errorf("expected object key, found %s", p.describe())
		}
		key, err := p.str()
		if err != nil {
			return jinja.Undefined(), err
		}
		p.skipSpace()
		if p.pos >= len(p.src) || p.src[p.pos] != ':' {
			return jinja.Undefined(), p.errorf("expected ':' after object key, found %s", p.describe())
		}
		p.pos++
		p.skipSpace()
		v, err := p.value(depth + 1)
		if err != nil {
			return jinja.Undefined(), err
		}
		// A repeated key keeps its first position and takes the last value,
		// as a Python dict built by json.loads does.
		dict.Set(key, v)
		p.skipSpace()
		if p.pos >= len(p.src) {
			return jinja.Undefined(), p.errorf("unexpected end of input in object")
		}
		switch p.src[p.pos] {
		case ',':
			p.pos++
		case '}':
			p.pos++
			return d, nil
		default:
			return jinja.Undefined(), p.errorf("expected ',' or '}' in object, found %s", p.describe())
		}
	}
}

func (p *jsonParser) array(depth int) (jinja.Value, error) {
	p.pos++ // '['
	var items []jinja.Value
	p.skipSpace()
	if p.pos < len(p.src) && p.src[p.pos] == ']' {
		p.pos++
		return jinja.NewList(items), nil
	}
	for {
		p.skipSpace()
		v, err := p.value(depth + 1)
		if err != nil {
			return jinja.Undefined(), err
		}
		items = append(items, v)
		p.skipSpace()
		if p.pos >= len(p.src) {
			return jinja.Undefined(), p.errorf("unexpected end of input in array")
		}
		switch p.src[p.pos] {
		case ',':
			p.pos++
		case ']':
			p.pos++
			return jinja.NewList(items), nil
		default:
			return jinja.Undefined(), p.errorf("expected ',' or ']' in array, found %s", p.describe())
		}
	}
}

func (p *jsonParser) number() (jinja.Value, error) {
	start := p.pos
	if p.src[p.pos] == '-' {
		p.pos++
	}
	digits := func() int {
		n := 0
		for p.pos < len(p.src) && p.src[p.pos] >= '0' && p.src[p.pos] <= '9' {
			p.pos++
			n++
		}
		return n
	}
	intStart := p.pos
	if n := digits(); n == 0 {
		return jinja.Undefined(), p.errorf("invalid number")
	} else if n > 1 && p.src[intStart] == '0' {
		return jinja.Undefined(), p.errorf("invalid number: leading zero")
	}
	isFloat := false
	if p.pos < len(p.src) && p.src[p.pos] == '.' {
		p.pos++
		isFloat = true
		if digits() == 0 {
			return jinja.Undefined(), p.errorf("invalid number: no digits after '.'")
		}
	}
	if p.pos < len(p.src) && (p.src[p.pos] == 'e' || p.src[p.pos] == 'E') {
		p.pos++
		isFloat = true
		if p.pos < len(p.src) && (p.src[p.pos] == '+' || p.src[p.pos] == '-') {
			p.pos++
		}
		if digits() == 0 {
			return jinja.Undefined(), p.errorf("invalid number: no digits in exponent")
		}
	}
	text := p.src[start:p.pos]
	if !isFloat {
		if n, err := strconv.ParseInt(text, 10, 64); err == nil {
			return jinja.NewInt(n), nil
		}
		// Beyond int64: Python keeps an exact big int; the nearest float is
		// the best jinja's value model can hold.
	}
	f, err := strconv.ParseFloat(text, 64)
	if err != nil && !isRangeError(err) {
		return jinja.Undefined(), p.errorf("invalid number %q", text)
	}
	// Out-of-range floats become ±Inf, as Python's float() does.
	return jinja.NewFloat(f), nil
}

func isRangeError(err error) bool {
	ne, ok := err.(*strconv.NumError)
	return ok && ne.Err == strconv.ErrRange
}

// str parses a JSON string starting at the opening quote. Invalid UTF-8 is
// replaced by U+FFFD, as encoding/json does. A string without escapes is a
// substring of src; otherwise plain runs are copied in bulk.
func (p *jsonParser) str() (string, error) {
	src := p.src
	i := p.pos + 1 // after the opening quote; kept local so it stays in a register
	start := i
	run := start // start of the plain run not yet copied to b
	var b strings.Builder
	copied := false // b holds the decoded prefix
	for i < len(src) {
		c := src[i]
		if plainASCII[c] {
			i++
			continue
		}
		switch {
		case c == '"':
			p.pos = i + 1
			if !copied {
				return src[start:i], nil
			}
			b.WriteString(src[run:i])
			return b.String(), nil
		case c == '\\':
			if !copied {
				// One allocation: the decoded text is never longer than
				// the raw text up to the closing quote.
				b.Grow(rawStringEnd(src, i) - start)
				copied = true
			}
			b.WriteString(src[run:i])
			p.pos = i
			if err := p.escape(&b); err != nil {
				return "", err
			}
			i = p.pos
			run = i
		case c < 0x20:
			p.pos = i
			return "", p.errorf("control character %#02x in string", c)
		default:
			r, size := utf8.DecodeRuneInString(src[i:])
			if r == utf8.RuneError && size == 1 {
				copied = true
				b.WriteString(src[run:i])
				b.WriteRune(utf8.RuneError)
				i++
				run = i
				continue
			}
			i += size
		}
	}
	p.pos = i
	return "", p.errorf("unterminated string")
}

// rawStringEnd returns the offset of the closing quote of the string that
// contains offset i (or len(src) if there is none). It jumps from quote to
// quote with IndexByte; a quote preceded by an odd run of backslashes is
// escaped.
func rawStringEnd(src string, i int) int {
	for {
		j := strings.IndexByte(src[i:], '"')
		if j < 0 {
			return len(src)
		}
		j += i
		k := j
		for k > i && src[k-1] == '\\' {
			k--
		}
		if (j-k)%2 == 0 {
			return j
		}
		i = j + 1
	}
}

func (p *jsonParser) escape(b *strings.Builder) error {
	p.pos++ // backslash
	if p.pos >= len(p.src) {
		return p.errorf("unterminated escape")
	}
	c := p.src[p.pos]
	p.pos++
	switch c {
	case '"', '\\', '/':
		b.WriteByte(c)
	case 'b':
		b.WriteByte('\b')
	case 'f':
		b.WriteByte('\f')
	case 'n':
		b.WriteByte('\n')
	case 'r':
		b.WriteByte('\r')
	case 't':
		b.WriteByte('\t')
	case 'u':
		r, ok := p.hex4()
		if !ok {
			return p.errorf("invalid \\u escape")
		}
		if utf16.IsSurrogate(r) {
			// A high surrogate followed by an escaped low one is one rune;
			// a lone surrogate becomes U+FFFD (Go strings cannot hold it).
			save := p.pos
			if strings.HasPrefix(p.src[p.pos:], "\\u") {
				p.pos += 2
				if r2, ok := p.hex4(); ok {
					if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
						b.WriteRune(dec)
						return nil
					}
				}
			}
			p.pos = save
			r = utf8.RuneError
		}
		b.WriteRune(r)
	default:
		p.pos--
		return p.errorf("invalid escape %s", p.describe())
	}
	return nil
}

func (p *jsonParser) hex4() (rune, bool) {
	if p.pos+4 > len(p.src) {
		return 0, false
	}
	var r rune
	for _, c := range []byte(p.src[p.pos : p.pos+4]) {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	p.pos += 4
	return r, true
}
