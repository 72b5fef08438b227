package proxy

import "bytes"

// Dialect reads and rewrites the answers of an API whose shape is not chat
// completions' (OpenAI's Responses, Anthropic's Messages): where their usage
// is, which stream event carries the first token, and what the client is
// to see. Request.Dialect nil means chat completions' shape.
type Dialect interface {
	// BodyUsage reads the usage of a non-streamed answer (-1, or 0 for
	// Completion, for what it does not say: see Usage).
	BodyUsage(body []byte) Usage
	// EventUsage reads it from one stream event's data; ok is false for an
	// event without usage.
	EventUsage(payload []byte) (u Usage, ok bool)
	// Output reports whether a stream event carries generated output: the
	// first such event is the first token (these APIs open a stream with
	// events sent before prefill).
	Output(payload []byte) bool
	// Rewrite returns an answer of target i (a body, or one event's data) as
	// the client gets it, nil when it is unchanged.
	Rewrite(i int, b []byte) []byte
	// StreamError is the event that ends a stream broken after it reached
	// the client, saying msg.
	StreamError(msg string) []byte
}

// dialected is a stream's Dialect with what relaying it needs: the target
// answering, and the call telling of its first token, made once.
type dialected struct {
	d      Dialect
	target int
	first  func()
}

// note reads one event's data, reports the first token and returns the
// data as the client gets it (nil: unchanged).
func (x *dialected) note(payload []byte, res *Result) []byte {
	if u, ok := x.d.EventUsage(payload); ok {
		res.setUsage(u)
	}
	if x.first != nil && x.d.Output(payload) {
		x.first()
		x.first = nil
	}
	return x.d.Rewrite(x.target, payload)
}

// dataLine finds the data of an event of the form these APIs send: an
// "event:" line, then one "data:" line. It returns the data's bounds in
// ev, or -1.
func dataLine(ev []byte) (start, end int) {
	for off := 0; off < len(ev); {
		line := ev[off:]
		n := bytes.IndexByte(line, '\n')
		if n >= 0 {
			line = line[:n]
		}
		line = bytes.TrimSuffix(line, []byte("\r"))
		if rest, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			lead := len(line) - len(rest)
			trimmed := bytes.TrimLeft(rest, " ")
			s := off + lead + len(rest) - len(trimmed)
			return s, off + len(line)
		}
		if n < 0 {
			break
		}
		off += n + 1
	}
	return -1, -1
}
