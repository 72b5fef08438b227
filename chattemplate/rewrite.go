package chattemplate

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// preprocess turns a chat template into source that jinja v1.8.0 renders
// the way jinja2 does, by doing jinja2's lexer work itself:
//
//   - newlines are folded ("\r\n" and "\r" to "\n", one trailing newline
//     dropped: keep_trailing_newline=False);
//   - whitespace control is applied as jinja2 does it ("-" and "+" markers,
//     trim_blocks, lstrip_blocks). jinja v1.8.0 gets this wrong: a block
//     tag's trim_blocks eats the first newline of the next *text* even
//     when an expression comes between ("{% for %}{{ x }}\n" loses the
//     "\n"). So every piece of text is emitted as a string literal
//     expression ({{ '...' }}), markers are removed, and jinja's own
//     trimming finds no text to touch;
//   - comments are dropped and {% raw %} bodies become literals;
//   - filters jinja gets wrong are renamed (see overriddenFilters), and
//     every printed expression goes through Python's str() (jinja prints
//     1.0 as "1" and None as "").
func preprocess(src string, direct bool) (code string, captures bool, err error) {
	src = foldNewlines(src)
	w := &emitter{direct: direct}
	w.out.Grow(len(src) + len(src)/4)
	pos := 0
	lineStarting := true // did the previous token end with "\n"?
	for {
		open := nextOpener(src, pos)
		if open < 0 {
			w.text(src[pos:])
			return w.out.String(), captures, nil
		}
		kind := src[open+1] // '{', '%' or '#'
		body := open + 2
		sign := byte(0)
		if body < len(src) && (src[body] == '-' || src[body] == '+') {
			sign = src[body]
			body++
		}
		w.text(leftStrip(src[pos:open], sign, kind != '{', lineStarting))

		if kind == '#' {
			end := strings.Index(src[body:], "#}")
			if end < 0 {
				return "", false, syntaxError(src, open, "unclosed comment")
			}
			end += body
			closeSign := byte(0)
			if end > body && (src[end-1] == '-' || src[end-1] == '+') {
				closeSign = src[end-1]
			}
			pos, lineStarting = rightStrip(src, end+2, closeSign, true)
			continue
		}

		closer := "}}"
		if kind == '%' {
			closer = "%}"
		}
		end, ok := findCloser(src, body, closer)
		if !ok {
			return "", false, syntaxError(src, open, "unclosed tag")
		}
		content := src[body:end]
		closeSign := byte(0)
		if strings.HasSuffix(content, "-") || (kind == '%' && strings.HasSuffix(content, "+")) {
			closeSign = content[len(content)-1]
			content = content[:len(content)-1]
		}
		after := end + 2

		if kind == '%' && strings.TrimSpace(content) == "raw" {
			// {% raw %}: no trim_blocks after the opening tag, only "-".
			if closeSign == '-' {
				after = skipSpace(src, after)
			}
			rawStart := after
			endOpen, endSign, endClose, closeEnd, found := findEndraw(src, rawStart)
			if !found {
				return "", false, syntaxError(src, open, "missing endraw")
			}
			rawLineStarting := after > 0 && src[after-1] == '\n'
			w.text(leftStrip(src[rawStart:endOpen], endSign, true, rawLineStarting))
			pos, lineStarting = rightStrip(src, closeEnd, endClose, true)
			continue
		}

		if kind == '{' {
			w.expr(rewriteCode(content))
		} else {
			switch stmtKeyword(content) {
			case "macro", "call", "filter":
				captures = true
			case "set":
				captures = captures || !strings.Contains(content, "=")
			}
			w.out.WriteString("{%")
			w.out.WriteString(rewriteCode(content))
			w.out.WriteString("%}")
		}
		pos, lineStarting = rightStrip(src, after, closeSign, kind == '%')
	}
}

// nextOpener finds the next "{{", "{%" or "{#" at or after pos.
func nextOpener(src string, pos int) int {
	for {
		i := strings.IndexByte(src[pos:], '{')
		if i < 0 {
			return -1
		}
		i += pos
		if i+1 < len(src) && (src[i+1] == '{' || src[i+1] == '%' || src[i+1] == '#') {
			return i
		}
		pos = i + 1
	}
}

// findCloser finds closer in a tag body, skipping quoted strings the way
// jinja's scanner does.
func findCloser(src string, i int, closer string) (int, bool) {
	for i+1 < len(src) {
		c := src[i]
		if c == '\'' || c == '"' {
			i++
			for i < len(src) && src[i] != c {
				if src[i] == '\\' {
					i++
				}
				i++
			}
			i++
			continue
		}
		if c == closer[0] && src[i+1] == closer[1] {
			return i, true
		}
		i++
	}
	return 0, false
}

// findEndraw locates "{%[-+] endraw [-+]%}" after a raw block's body: where
// it opens, its two whitespace-control signs and where it ends.
func findEndraw(src string, from int) (open int, openSign, closeSign byte, closeEnd int, ok bool) {
	for pos := from; ; {
		i := strings.Index(src[pos:], "{%")
		if i < 0 {
			return 0, 0, 0, 0, false
		}
		open = pos + i
		b := open + 2
		var sign byte
		if b < len(src) && (src[b] == '-' || src[b] == '+') {
			sign = src[b]
			b++
		}
		end, found := findCloser(src, b, "%}")
		if found {
			content := src[b:end]
			var cs byte
			if strings.HasSuffix(content, "-") || strings.HasSuffix(content, "+") {
				cs = content[len(content)-1]
				content = content[:len(content)-1]
			}
			if strings.TrimSpace(content) == "endraw" {
				return open, sign, cs, end + 2, true
			}
		}
		pos = open + 2
	}
}

// leftStrip applies whitespace control to the text before a tag: "-"
// strips all trailing whitespace; otherwise lstrip_blocks strips the
// indentation before a block or comment tag that starts its line.
func leftStrip(text string, sign byte, isBlock, lineStarting bool) string {
	switch {
	case sign == '-':
		return strings.TrimRightFunc(text, pyIsSpace)
	case sign == '+' || !isBlock:
		return text
	}
	lpos := strings.LastIndexByte(text, '\n') + 1
	if lpos == 0 && !lineStarting {
		return text
	}
	rest := text[lpos:]
	if rest != "" && strings.TrimLeftFunc(rest, pyIsSpace) == "" {
		return text[:lpos]
	}
	return text
}

// rightStrip applies whitespace control after a tag ending at pos: "-"
// skips all whitespace; trim_blocks (block and comment tags without "+")
// skips one "\n". It reports where text resumes and whether the tag's match
// ended with a newline (jinja2's line_starting).
func rightStrip(src string, pos int, sign byte, isBlock bool) (int, bool) {
	switch {
	case sign == '-':
		pos = skipSpace(src, pos)
	case sign != '+' && isBlock && pos < len(src) && src[pos] == '\n':
		pos++
	}
	return pos, pos > 0 && src[pos-1] == '\n'
}

func skipSpace(src string, pos int) int {
	for pos < len(src) {
		r, size := utf8.DecodeRuneInString(src[pos:])
		if !pyIsSpace(r) {
			break
		}
		pos += size
	}
	return pos
}

// emitter writes preprocessed template source. Normally text becomes
// {{ 'text' }} and each expression {{ (expr) | kvmesh_str__ }}. In direct
// mode every piece of output instead goes through kvmesh_emit__(...), which
// appends to a buffer Render pre-sizes: jinja's own output builder starts
// empty and doubles, which for a 130 KB prompt copied and allocated several
// times the prompt. Direct mode is only used when no construct captures
// output (macros, call and filter blocks, {% set x %} blocks).
type emitter struct {
	out    strings.Builder
	direct bool
}

func (w *emitter) text(text string) {
	if text == "" {
		return
	}
	if w.direct {
		w.out.WriteString("{{ " + emitFuncName + "(")
		writeJinjaString(&w.out, text)
		w.out.WriteString(") }}")
		return
	}
	w.out.WriteString("{{ ")
	writeJinjaString(&w.out, text)
	w.out.WriteString(" }}")
}

func (w *emitter) expr(code string) {
	switch {
	case w.direct:
		w.out.WriteString("{{ " + emitFuncName + "((")
		w.out.WriteString(code)
		w.out.WriteString(")) }}")
	case isStringLiteral(code):
		w.out.WriteString("{{")
		w.out.WriteString(code)
		w.out.WriteString("}}")
	default:
		// jinja prints values Go-style (1.0 as "1", None as ""); route
		// every printed value through Python's str() instead.
		w.out.WriteString("{{ (")
		w.out.WriteString(code)
		w.out.WriteString(") | " + pyStrFilterName + " }}")
	}
}

// emitFuncName is the per-render variable that appends to the output
// buffer in direct mode.
const emitFuncName = "kvmesh_emit__"

func syntaxError(src string, at int, what string) error {
	line := 1 + strings.Count(src[:at], "\n")
	return fmt.Errorf("%s at line %d", what, line)
}

// foldNewlines does what jinja2's lexer does to template source before
// anything else: every "\r\n", "\r" and "\n" becomes "\n", and one trailing
// newline is dropped (keep_trailing_newline=False).
func foldNewlines(src string) string {
	if strings.IndexByte(src, '\r') >= 0 {
		src = strings.ReplaceAll(src, "\r\n", "\n")
		src = strings.ReplaceAll(src, "\r", "\n")
	}
	return strings.TrimSuffix(src, "\n")
}

// Filters jinja v1.8.0 gets wrong or lacks. Its filter lookup consults only
// its own built-ins, then falls back to a template variable of the same
// name, so a built-in cannot be replaced directly; instead rewriteCode
// renames "| tojson" in tag code to "| kvmesh_tojson__", which Render
// supplies.
var overriddenFilters = map[string]string{
	"tojson": "kvmesh_tojson__",
	"trim":   "kvmesh_trim__",
	"string": pyStrFilterName,
	"list":   "kvmesh_list__",
	"format": "kvmesh_format__",
}

// pyStrFilterName is the variable holding Python's str() as a filter; every
// printed expression is piped through it.
const pyStrFilterName = "kvmesh_str__"

// isStringLiteral reports whether code is one quoted string and nothing
// else (such output needs no str() conversion).
func isStringLiteral(code string) bool {
	code = strings.TrimSpace(code)
	if len(code) < 2 || (code[0] != '\'' && code[0] != '"') {
		return false
	}
	q := code[0]
	i := 1
	for i < len(code) && code[i] != q {
		if code[i] == '\\' {
			i++
		}
		i++
	}
	return i == len(code)-1
}

// rewriteCode rewrites the code of one tag for jinja v1.8.0:
//   - identifiers named in overriddenFilters that directly follow a '|'
//     are renamed (only filter applications change);
//   - string literals are decoded as jinja2 decodes them (Python escapes:
//     \u00e9, \x41, \r, octal, ...) and re-quoted with only the escapes
//     jinja understands;
//   - float literals with an exponent but no '.' (1e-7), which jinja cannot
//     parse, get one (1.0e-7).
func rewriteCode(code string) string {
	var b strings.Builder
	b.Grow(len(code) + 16)
	prev := byte(0) // previous significant character
	for j := 0; j < len(code); {
		c := code[j]
		switch {
		case c == '\'' || c == '"':
			k := j + 1
			for k < len(code) && code[k] != c {
				if code[k] == '\\' {
					k++
				}
				k++
			}
			if k >= len(code) { // unterminated: leave it to jinja's parser
				b.WriteString(code[j:])
				return b.String()
			}
			writeJinjaString(&b, decodePyStringLiteral(code[j+1:k]))
			j = k + 1
			prev = c
		case isIdentStart(c):
			k := j
			for k < len(code) && isIdentChar(code[k]) {
				k++
			}
			name := code[j:k]
			if repl, ok := overriddenFilters[name]; ok && prev == '|' {
				name = repl
			}
			b.WriteString(name)
			prev = 'a'
			j = k
		case c >= '0' && c <= '9':
			k := j
			for k < len(code) && code[k] >= '0' && code[k] <= '9' {
				k++
			}
			hasDot := false
			if k+1 < len(code) && code[k] == '.' && code[k+1] >= '0' && code[k+1] <= '9' {
				hasDot = true
				k++
				for k < len(code) && code[k] >= '0' && code[k] <= '9' {
					k++
				}
			}
			mantissaEnd := k
			if k < len(code) && (code[k] == 'e' || code[k] == 'E') {
				e := k + 1
				if e < len(code) && (code[e] == '+' || code[e] == '-') {
					e++
				}
				if e < len(code) && code[e] >= '0' && code[e] <= '9' {
					for e < len(code) && code[e] >= '0' && code[e] <= '9' {
						e++
					}
					k = e
				}
			}
			b.WriteString(code[j:mantissaEnd])
			if k > mantissaEnd && !hasDot {
				b.WriteString(".0")
			}
			b.WriteString(code[mantissaEnd:k])
			prev = '0'
			j = k
		default:
			b.WriteByte(c)
			if c != ' ' && c != '\t' && c != '\n' {
				prev = c
			}
			j++
		}
	}
	return b.String()
}

// decodePyStringLiteral decodes the body of a jinja2 string literal the way
// jinja2 does (Python's unicode-escape codec): \n \t \r \\ \' \" \a \b
// \f \v, octal \ooo, \xhh, \uXXXX, \UXXXXXXXX and backslash-newline;
// an unknown or malformed escape keeps its backslash.
func decodePyStringLiteral(s string) string {
	if strings.IndexByte(s, '\\') < 0 {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' || i+1 >= len(s) {
			b.WriteByte(c)
			continue
		}
		i++
		switch e := s[i]; e {
		case '\n':
			// line continuation: nothing
		case '\\', '\'', '"':
			b.WriteByte(e)
		case 'a':
			b.WriteByte('\a')
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
		case 'v':
			b.WriteByte('\v')
		case '0', '1', '2', '3', '4', '5', '6', '7':
			n, k := 0, i
			for k < len(s) && k < i+3 && s[k] >= '0' && s[k] <= '7' {
				n = n*8 + int(s[k]-'0')
				k++
			}
			b.WriteRune(rune(n))
			i = k - 1
		case 'x', 'u', 'U':
			width := map[byte]int{'x': 2, 'u': 4, 'U': 8}[e]
			r, ok := parseHex(s, i+1, width)
			if !ok || !utf8.ValidRune(r) {
				b.WriteByte('\\')
				b.WriteByte(e)
				continue
			}
			b.WriteRune(r)
			i += width
		default:
			b.WriteByte('\\')
			b.WriteByte(e)
		}
	}
	return b.String()
}

func parseHex(s string, from, width int) (rune, bool) {
	if from+width > len(s) {
		return 0, false
	}
	var r rune
	for _, c := range []byte(s[from : from+width]) {
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
	return r, true
}

// writeJinjaString quotes s for jinja's tokenizer, which understands only
// \\, \' and \n (other bytes may appear raw).
func writeJinjaString(b *strings.Builder, s string) {
	b.WriteByte('\'')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '\\':
			b.WriteString(`\\`)
		case '\'':
			b.WriteString(`\'`)
		case '\n':
			b.WriteString(`\n`)
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('\'')
}

// stmtKeyword returns the first word of a statement tag's content.
func stmtKeyword(s string) string {
	s = strings.TrimLeft(s, " \t\n")
	k := 0
	for k < len(s) && isIdentChar(s[k]) {
		k++
	}
	return s[:k]
}

func isIdentStart(c byte) bool {
	return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
}

func isIdentChar(c byte) bool {
	return isIdentStart(c) || (c >= '0' && c <= '9')
}
