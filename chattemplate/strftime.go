package chattemplate

import (
	"strconv"
	"strings"
	"time"
)

// strftime formats t as Python's datetime.strftime does on glibc (the C
// locale), for the directives chat templates use ("%d %b %Y", "%Y-%m-%d",
// ...). transformers passes a naive datetime.now(), so %Z and %z are empty.
// glibc's "%-d" (no padding) is supported; unknown directives are copied as
// they are, as glibc does.
func strftime(format string, t time.Time) string {
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '%' || i+1 >= len(format) {
			b.WriteByte(c)
			continue
		}
		i++
		noPad := false
		if format[i] == '-' && i+1 < len(format) {
			noPad = true
			i++
		}
		num := func(n, width int) {
			s := strconv.Itoa(n)
			if !noPad {
				for len(s) < width {
					s = "0" + s
				}
			}
			b.WriteString(s)
		}
		switch format[i] {
		case 'a':
			b.WriteString(t.Weekday().String()[:3])
		case 'A':
			b.WriteString(t.Weekday().String())
		case 'b', 'h':
			b.WriteString(t.Month().String()[:3])
		case 'B':
			b.WriteString(t.Month().String())
		case 'c':
			b.WriteString(t.Format("Mon Jan _2 15:04:05 2006"))
		case 'd':
			num(t.Day(), 2)
		case 'e':
			if noPad {
				num(t.Day(), 1)
			} else {
				b.WriteString(t.Format("_2"))
			}
		case 'F':
			b.WriteString(t.Format("2006-01-02"))
		case 'H':
			num(t.Hour(), 2)
		case 'I':
			h := t.Hour() % 12
			if h == 0 {
				h = 12
			}
			num(h, 2)
		case 'j':
			num(t.YearDay(), 3)
		case 'm':
			num(int(t.Month()), 2)
		case 'M':
			num(t.Minute(), 2)
		case 'p':
			if t.Hour() < 12 {
				b.WriteString("AM")
			} else {
				b.WriteString("PM")
			}
		case 'S':
			num(t.Second(), 2)
		case 'f':
			num(t.Nanosecond()/1000, 6)
		case 'T':
			b.WriteString(t.Format("15:04:05"))
		case 'u':
			wd := int(t.Weekday())
			if wd == 0 {
				wd = 7
			}
			num(wd, 1)
		case 'w':
			num(int(t.Weekday()), 1)
		case 'U':
			num((t.YearDay()+6-int(t.Weekday()))/7, 2)
		case 'W':
			num((t.YearDay()+6-(int(t.Weekday())+6)%7)/7, 2)
		case 'x':
			b.WriteString(t.Format("01/02/06"))
		case 'X':
			b.WriteString(t.Format("15:04:05"))
		case 'y':
			num(t.Year()%100, 2)
		case 'Y':
			num(t.Year(), 1)
		case 'z', 'Z':
			// naive datetime: empty
		case 'n':
			b.WriteByte('\n')
		case 't':
			b.WriteByte('\t')
		case '%':
			b.WriteByte('%')
		default:
			b.WriteByte('%')
			if noPad {
				b.WriteByte('-')
			}
			b.WriteByte(format[i])
		}
	}
	return b.String()
}
