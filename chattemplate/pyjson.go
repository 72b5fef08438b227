package chattemplate

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"
)

// dumpOptions are the json.dumps arguments transformers' tojson filter
// exposes: tojson(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False).
type dumpOptions struct {
	ensureASCII bool
	indent      *string // nil: single line
	itemSep     string
	keySep      string
	sortKeys    bool
}

// tojsonFilter replaces jinja's built-in tojson: Python's json.dumps as
// transformers calls it. The built-in (v1.8.0) sorts and HTML-escapes keys
// with indent=, escapes U+2028/U+2029 and prints 1.0 as 1.
func tojsonFilter(args []jinja.Value, kwargs map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), fmt.Errorf("tojson: missing value")
	}
	// Positional parameters after the value, in transformers' order.
	names := [...]string{"ensure_ascii", "indent", "separators", "sort_keys"}
	if len(args)-1 > len(names) {
		return jinja.Undefined(), fmt.Errorf("tojson() takes at most %d arguments (%d given)", len(names)+1, len(args))
	}
	param := func(i int) (jinja.Value, bool) {
		if i+1 < len(args) {
			return args[i+1], true
		}
		v, ok := kwargs[names[i]]
		return v, ok
	}
	for k := range kwargs {
		switch k {
		case "ensure_ascii", "indent", "separators", "sort_keys":
		default:
			return jinja.Undefined(), fmt.Errorf("tojson() got an unexpected keyword argument %q", k)
		}
	}

	opt := dumpOptions{itemSep: ", ", keySep: ": "}
	if v, ok := param(0); ok {
		opt.ensureASCII = v.IsTruthy()
	}
	if v, ok := param(1); ok && !v.IsNone() && !v.IsUndefined() {
		var ind string
		switch {
		case v.IsString():
			ind = v.AsString()
		case v.IsInt():
			ind = strings.Repeat(" ", int(max(0, min(v.AsInt(), 64))))
		case v.IsBool():
			if v.AsBool() {
				ind = " "
			}
		default:
			return jinja.Undefined(), fmt.Errorf("tojson: indent must be an int or a string")
		}
		opt.indent = &ind
		opt.itemSep = "," // json.dumps default when indent is set
	}
	if v, ok := param(2); ok && !v.IsNone() && !v.IsUndefined() {
		if !v.IsList() || v.AsList().Len() != 2 || !v.AsList().Get(0).IsString() || !v.AsList().Get(1).IsString() {
			return jinja.Undefined(), fmt.Errorf("tojson: separators must be a pair of strings")
		}
		opt.itemSep = v.AsList().Get(0).AsString()
		opt.keySep = v.AsList().Get(1).AsString()
	}
	if v, ok := param(3); ok {
		opt.sortKeys = v.IsTruthy()
	}

	var b strings.Builder
	if err := dumpJSON(&b, args[0], &opt, 0, 0); err != nil {
		return jinja.Undefined(), err
	}
	return jinja.NewString(b.String()), nil
}

// maxDumpDepth stops reference cycles a template could build with
// list.append (json.dumps raises "Circular reference detected").
const maxDumpDepth = 1000

func dumpJSON(b *strings.Builder, v jinja.Value, opt *dumpOptions, level, depth int) error {
	if depth > maxDumpDepth {
		return fmt.Errorf("ValueError: Circular reference detected")
	}
	switch {
	case v.IsNone():
		b.WriteString("null")
	case v.IsBool():
		if v.AsBool() {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case v.IsInt():
		b.WriteString(strconv.FormatInt(v.AsInt(), 10))
	case v.IsFloat():
		f := v.AsFloat()
		switch {
		case math.IsNaN(f):
			b.WriteString("NaN")
		case math.IsInf(f, 1):
			b.WriteString("Infinity")
		case math.IsInf(f, -1):
			b.WriteString("-Infinity")
		default:
			b.WriteString(pyFloatRepr(f))
		}
	case v.IsString():
		writeJSONString(b, v.AsString(), opt.ensureASCII)
	case v.IsList():
		items := v.AsList().Items
		if len(items) == 0 {
			b.WriteString("[]")
			return nil
		}
		b.WriteByte('[')
		for i, item := range items {
			if i > 0 {
				b.WriteString(opt.itemSep)
			}
			newline(b, opt, level+1)
			if err := dumpJSON(b, item, opt, level+1, depth+1); err != nil {
				return err
			}
		}
		newline(b, opt, level)
		b.WriteByte(']')
	case v.IsDict():
		d := v.AsDict()
		if d.Len() == 0 {
			b.WriteString("{}")
			return nil
		}
		keys := d.Keys
		if opt.sortKeys {
			keys = d.OrderedKeys()
			sort.Strings(keys) // UTF-8 byte order == code point order == Python's
		}
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(opt.itemSep)
			}
			newline(b, opt, level+1)
			writeJSONString(b, k, opt.ensureASCII)
			b.WriteString(opt.keySep)
			val, _ := d.Get(k)
			if err := dumpJSON(b, val, opt, level+1, depth+1); err != nil {
				return err
			}
		}
		newline(b, opt, level)
		b.WriteByte('}')
	case v.IsUndefined():
		return fmt.Errorf("TypeError: Object of type Undefined is not JSON serializable")
	default:
		return fmt.Errorf("TypeError: Object of type function is not JSON serializable")
	}
	return nil
}

func newline(b *strings.Builder, opt *dumpOptions, level int) {
	if opt.indent == nil {
		return
	}
	b.WriteByte('\n')
	for range level {
		b.WriteString(*opt.indent)
	}
}

const hexDigits = "0123456789abcdef"

// writeJSONString quotes s as Python's json encoder does: with
// ensure_ascii=False only '"', '\\' and C0 controls are escaped (U+2028 and
// DEL stay as they are); with ensure_ascii=True everything outside ' '..'~'
// becomes \uXXXX (surrogate pairs above the BMP).
func writeJSONString(b *strings.Builder, s string, ensureASCII bool) {
	b.WriteByte('"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < 0x7f {
			i++
			continue
		}
		if c >= 0x7f && !ensureASCII {
			i++
			continue
		}
		b.WriteString(s[start:i])
		size := 1
		switch c {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			var r rune
			if c < utf8.RuneSelf {
				r = rune(c)
			} else {
				r, size = utf8.DecodeRuneInString(s[i:])
			}
			if r > 0xffff {
				r -= 0x10000
				writeU4(b, 0xd800+(r>>10))
				writeU4(b, 0xdc00+(r&0x3ff))
			} else {
				writeU4(b, r)
			}
		}
		i += size
		start = i
	}
	b.WriteString(s[start:])
	b.WriteByte('"')
}

func writeU4(b *strings.Builder, r rune) {
	b.WriteString(`\u`)
	b.WriteByte(hexDigits[r>>12&0xf])
	b.WriteByte(hexDigits[r>>8&0xf])
	b.WriteByte(hexDigits[r>>4&0xf])
	b.WriteByte(hexDigits[r&0xf])
}

// pyFloatRepr is Python's repr(float): the shortest round-tripping digits,
// in positional form with a ".0" when integral, or in scientific form
// ("1e-05", "1.5e+16") when the exponent is below -4 or at least 16.
func pyFloatRepr(f float64) string {
	sci := strconv.FormatFloat(f, 'e', -1, 64) // e.g. "1.5e+16", "1e-05"
	e := strings.LastIndexByte(sci, 'e')
	exp, _ := strconv.Atoi(sci[e+1:])
	if exp < -4 || exp >= 16 {
		return sci
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".") {
		s += ".0"
	}
	return s
}

// pyIsSpace is Python's str.isspace for one rune: Unicode White_Space plus
// the C0 separators U+001C..U+001F, which Go's unicode.IsSpace lacks.
func pyIsSpace(r rune) bool {
	return unicode.IsSpace(r) || (r >= 0x1c && r <= 0x1f)
}

// pyStr is Python's str() of a template value, as jinja2 prints it.
func pyStr(v jinja.Value) string {
	switch {
	case v.IsString():
		return v.AsString()
	case v.IsUndefined():
		return ""
	case v.IsNone():
		return "None"
	case v.IsFloat():
		return pyFloatRepr(v.AsFloat())
	default:
		var b strings.Builder
		pyRepr(&b, v, 0)
		return b.String()
	}
}

// pyRepr writes Python's repr() of v (lists and dicts print their items with
// repr, so strings are quoted inside containers).
func pyRepr(b *strings.Builder, v jinja.Value, depth int) {
	if depth > maxDumpDepth {
		b.WriteString("...")
		return
	}
	switch {
	case v.IsNone():
		b.WriteString("None")
	case v.IsUndefined():
		b.WriteString("Undefined")
	case v.IsBool():
		if v.AsBool() {
			b.WriteString("True")
		} else {
			b.WriteString("False")
		}
	case v.IsInt():
		b.WriteString(strconv.FormatInt(v.AsInt(), 10))
	case v.IsFloat():
		f := v.AsFloat()
		switch {
		case math.IsNaN(f):
			b.WriteString("nan")
		case math.IsInf(f, 1):
			b.WriteString("inf")
		case math.IsInf(f, -1):
			b.WriteString("-inf")
		default:
			b.WriteString(pyFloatRepr(f))
		}
	case v.IsString():
		pyQuote(b, v.AsString())
	case v.IsList():
		b.WriteByte('[')
		for i, item := range v.AsList().Items {
			if i > 0 {
				b.WriteString(", ")
			}
			pyRepr(b, item, depth+1)
		}
		b.WriteByte(']')
	case v.IsDict():
		d := v.AsDict()
		b.WriteByte('{')
		for i, k := range d.Keys {
			if i > 0 {
				b.WriteString(", ")
			}
			pyQuote(b, k)
			b.WriteString(": ")
			val, _ := d.Get(k)
			pyRepr(b, val, depth+1)
		}
		b.WriteByte('}')
	default:
		b.WriteString("<function>")
	}
}

// pyQuote is repr(str): single quotes unless the text has a single quote
// and no double quote; backslash escapes for the quote, '\\', \n \r \t and
// other non-printable characters.
func pyQuote(b *strings.Builder, s string) {
	q := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		q = '"'
	}
	b.WriteByte(q)
	for _, r := range s {
		switch {
		case r == rune(q) || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f:
			b.WriteString(`\x`)
			b.WriteByte(hexDigits[r>>4])
			b.WriteByte(hexDigits[r&0xf])
		case r >= 0x80 && !unicode.IsPrint(r):
			switch {
			case r <= 0xff:
				b.WriteString(`\x`)
				b.WriteByte(hexDigits[r>>4])
				b.WriteByte(hexDigits[r&0xf])
			case r <= 0xffff:
				b.WriteString(`\u`)
				for sh := 12; sh >= 0; sh -= 4 {
					b.WriteByte(hexDigits[r>>sh&0xf])
				}
			default:
				b.WriteString(`\U`)
				for sh := 28; sh >= 0; sh -= 4 {
					b.WriteByte(hexDigits[r>>sh&0xf])
				}
			}
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte(q)
}

// trimFilter replaces jinja's trim: jinja2's do_trim is str(value).strip(chars),
// and Python's strip() removes U+001C..U+001F too.
func trimFilter(args []jinja.Value, kwargs map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), fmt.Errorf("trim: missing value")
	}
	s := pyStr(args[0])
	chars, ok := jinja.Undefined(), false
	if len(args) > 1 {
		chars, ok = args[1], true
	} else if v, has := kwargs["chars"]; has {
		chars, ok = v, true
	}
	if ok && !chars.IsNone() && !chars.IsUndefined() {
		if !chars.IsString() {
			return jinja.Undefined(), fmt.Errorf("TypeError: strip arg must be None or str")
		}
		return jinja.NewString(strings.Trim(s, chars.AsString())), nil
	}
	return jinja.NewString(strings.TrimFunc(s, pyIsSpace)), nil
}

// listFilter is jinja2's list: Python's list(x) — a dict gives its keys, a
// string its characters.
func listFilter(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), fmt.Errorf("list: missing value")
	}
	v := args[0]
	switch {
	case v.IsList():
		return jinja.NewList(append([]jinja.Value(nil), v.AsList().Items...)), nil
	case v.IsDict():
		keys := v.AsDict().Keys
		items := make([]jinja.Value, len(keys))
		for i, k := range keys {
			items[i] = jinja.NewString(k)
		}
		return jinja.NewList(items), nil
	case v.IsString():
		var items []jinja.Value
		for _, r := range v.AsString() {
			items = append(items, jinja.NewString(string(r)))
		}
		return jinja.NewList(items), nil
	case v.IsUndefined():
		return jinja.NewList(nil), nil
	}
	return jinja.Undefined(), fmt.Errorf("TypeError: object is not iterable")
}

// formatFilter is jinja2's format: str(value) % args, for the conversions
// chat templates use (%s %r %d %i %f %x %%, with width and precision).
func formatFilter(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), fmt.Errorf("format: missing value")
	}
	format, rest := pyStr(args[0]), args[1:]
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '%' {
			b.WriteByte(c)
			continue
		}
		j := i + 1
		for j < len(format) && strings.IndexByte("-+ 0#", format[j]) >= 0 {
			j++
		}
		for j < len(format) && (format[j] >= '0' && format[j] <= '9' || format[j] == '.') {
			j++
		}
		if j >= len(format) {
			return jinja.Undefined(), fmt.Errorf("ValueError: incomplete format")
		}
		spec, conv := format[i+1:j], format[j]
		i = j
		if conv == '%' {
			b.WriteByte('%')
			continue
		}
		if len(rest) == 0 {
			return jinja.Undefined(), fmt.Errorf("TypeError: not enough arguments for format string")
		}
		arg := rest[0]
		rest = rest[1:]
		switch conv {
		case 's':
			fmt.Fprintf(&b, "%"+spec+"s", pyStr(arg))
		case 'r':
			var r strings.Builder
			pyRepr(&r, arg, 0)
			fmt.Fprintf(&b, "%"+spec+"s", r.String())
		case 'd', 'i', 'x', 'X', 'o':
			if !arg.IsNumber() && !arg.IsBool() {
				return jinja.Undefined(), fmt.Errorf("TypeError: %%%c format: a real number is required", conv)
			}
			n := int64(0)
			switch {
			case arg.IsInt():
				n = arg.AsInt()
			case arg.IsFloat():
				n = int64(arg.AsFloat())
			case arg.AsBool():
				n = 1
			}
			verb := map[byte]string{'d': "d", 'i': "d", 'x': "x", 'X': "X", 'o': "o"}[conv]
			fmt.Fprintf(&b, "%"+spec+verb, n)
		case 'f', 'F', 'e', 'E', 'g', 'G':
			if !arg.IsNumber() {
				return jinja.Undefined(), fmt.Errorf("TypeError: must be real number")
			}
			f := 0.0
			if arg.IsInt() {
				f = float64(arg.AsInt())
			} else {
				f = arg.AsFloat()
			}
			if !strings.Contains(spec, ".") && (conv == 'f' || conv == 'F' || conv == 'e' || conv == 'E') {
				spec += ".6"
			}
			fmt.Fprintf(&b, "%"+spec+string(conv), f)
		default:
			return jinja.Undefined(), fmt.Errorf("ValueError: unsupported format character %q", conv)
		}
	}
	if len(rest) > 0 {
		return jinja.Undefined(), fmt.Errorf("TypeError: not all arguments converted during string formatting")
	}
	return jinja.NewString(b.String()), nil
}
