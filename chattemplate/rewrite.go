package chattemplate

import "strings"

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

// Filters jinja v1.8.0 gets wrong. Its filter lookup consults only its own
// built-ins, then falls back to a template variable of the same name, so a
// built-in cannot be replaced directly; instead renameFilters rewrites
// "| tojson" in the source to "| kvmesh_tojson__", which Render supplies.
var overriddenFilters = map[string]string{
	"tojson": "kvmesh_tojson__",
	"trim":   "kvmesh_trim__",
}

// renameFilters rewrites filter applications named in overriddenFilters.
// It scans tags the way jinja's scanner does ({{ }}, {% %}, {# #}, quoted
// strings inside tags, {% raw %} bodies left alone) and renames an
// identifier only where it directly follows a '|' inside a tag, so text,
// string literals and attribute names are never touched.
func renameFilters(src string) string {
	var b strings.Builder
	last := 0 // src[last:] not yet copied to b
	inRaw := false
	for i := 0; i+1 < len(src); {
		if src[i] != '{' {
			i++
			continue
		}
		var closer string
		switch src[i+1] {
		case '{':
			closer = "}}"
		case '%':
			closer = "%}"
		case '#':
			closer = "#}"
		default:
			i++
			continue
		}
		if closer == "#}" {
			end := strings.Index(src[i+2:], "#}")
			if end < 0 {
				break // unclosed: let jinja report it
			}
			i += 2 + end + 2
			continue
		}
		// Find the closer, skipping quoted strings as jinja's scanner does.
		j := i + 2
		var names []int // byte offsets of identifiers to rename
		prevSignificant := byte(0)
		for j < len(src) {
			c := src[j]
			if c == '\'' || c == '"' {
				j++
				for j < len(src) && src[j] != c {
					if src[j] == '\\' && j+1 < len(src) {
						j++
					}
					j++
				}
				j++
				prevSignificant = c
				continue
			}
			if j+1 < len(src) && c == closer[0] && src[j+1] == closer[1] {
				break
			}
			if isIdentStart(c) {
				k := j
				for k < len(src) && isIdentChar(src[k]) {
					k++
				}
				if prevSignificant == '|' && !inRaw {
					if _, ok := overriddenFilters[src[j:k]]; ok {
						names = append(names, j)
					}
				}
				prevSignificant = 'a'
				j = k
				continue
			}
			if c != ' ' && c != '\t' && c != '\n' && c != '\r' {
				prevSignificant = c
			}
			j++
		}
		if j >= len(src) {
			break // unclosed tag: jinja reports it
		}
		if closer == "%}" {
			switch stmtKeyword(src[i+2 : j]) {
			case "raw":
				inRaw = true
			case "endraw":
				inRaw = false
			}
		}
		for _, n := range names {
			k := n
			for k < len(src) && isIdentChar(src[k]) {
				k++
			}
			b.WriteString(src[last:n])
			b.WriteString(overriddenFilters[src[n:k]])
			last = k
		}
		i = j + 2
	}
	if last == 0 {
		return src
	}
	b.WriteString(src[last:])
	return b.String()
}

// stmtKeyword returns the first word of a statement tag's content.
func stmtKeyword(s string) string {
	s = strings.TrimLeft(s, "-+ \t\n\r")
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
