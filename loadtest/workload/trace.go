package workload

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"
)

// TraceBlockTokens is the block size of Mooncake trace hash ids.
const TraceBlockTokens = 512

// maxTraceInput bounds one record's input length so a bad line cannot ask
// for gigabytes of text.
const maxTraceInput = 1 << 20

// TraceRecord is one line of a Mooncake-format trace.
type TraceRecord struct {
	Timestamp    int64   `json:"timestamp"` // ms since the trace start
	InputLength  int     `json:"input_length"`
	OutputLength int     `json:"output_length"`
	HashIDs      []int64 `json:"hash_ids"`
}

// TraceParams select and pace part of a trace.
type TraceParams struct {
	Start   time.Duration // skip records before this trace time
	Window  time.Duration // keep records before Start+Window; 0 keeps all
	Limit   int           // keep at most this many records; 0 keeps all
	Speedup float64       // arrival = (timestamp-Start)/Speedup; 0 means 1
	// MaxOutput caps output tokens per request (0: the trace's own).
	MaxOutput int
}

// ParseTrace reads Mooncake JSONL records, keeping those the window and
// limit select. Blank lines are skipped; a malformed line is an error
// naming its line number.
func ParseTrace(r io.Reader, p TraceParams) ([]TraceRecord, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 16<<20)
	var out []TraceRecord
	start := p.Start.Milliseconds()
	line := 0
	last := int64(0)
	for sc.Scan() {
		line++
		text := strings.TrimSpace(sc.Text())
		if text == "" {
			continue
		}
		var rec TraceRecord
		if err := json.Unmarshal([]byte(text), &rec); err != nil {
			return nil, fmt.Errorf("trace line %d: %w", line, err)
		}
		if rec.Timestamp < 0 || rec.InputLength < 0 || rec.OutputLength < 0 || rec.InputLength > maxTraceInput {
			return nil, fmt.Errorf("trace line %d: timestamp, input_length and output_length must be in range, got %d, %d, %d",
				line, rec.Timestamp, rec.InputLength, rec.OutputLength)
		}
		if len(rec.HashIDs) > rec.InputLength/TraceBlockTokens+1 {
			return nil, fmt.Errorf("trace line %d: %d hash ids for %d input tokens", line, len(rec.HashIDs), rec.InputLength)
		}
		if rec.Timestamp < last {
			return nil, fmt.Errorf("trace line %d: timestamp %d before the previous %d; a trace must be in arrival order", line, rec.Timestamp, last)
		}
		last = rec.Timestamp
		if rec.Timestamp < start {
			continue
		}
		if p.Window > 0 && rec.Timestamp >= start+p.Window.Milliseconds() {
			break
		}
		out = append(out, rec)
		if p.Limit > 0 && len(out) >= p.Limit {
			break
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("trace line %d: %w", line+1, err)
	}
	if len(out) == 0 {
		return nil, errors.New("trace: no records in the selected window")
	}
	return out, nil
}

// Trace turns records into requests: each hash id becomes a deterministic
// 512-word block (a prefix of it for a final partial block), input tokens
// beyond the hash ids become a tail unique to the request, so equal hash-id
// prefixes are equal token prefixes. The prompt is one user message.
func Trace(recs []TraceRecord, p TraceParams, seed uint64) (Workload, error) {
	const name = "trace"
	speed := p.Speedup
	if speed <= 0 {
		speed = 1
	}
	blocks := map[int64]string{}
	blockText := func(id int64) string {
		if s, ok := blocks[id]; ok {
			return s
		}
		s := Words(seed, fmt.Sprintf("blk/%d", id), TraceBlockTokens)
		blocks[id] = s
		return s
	}
	start := p.Start.Milliseconds()
	reqs := make([]Request, 0, len(recs))
	for i, rec := range recs {
		var b strings.Builder
		words := 0
		for _, id := range rec.HashIDs {
			n := min(TraceBlockTokens, rec.InputLength-words)
			if n <= 0 {
				break
			}
			appendWords(&b, firstWords(blockText(id), n))
			words += n
		}
		if tail := rec.InputLength - words; tail > 0 {
			appendWords(&b, Words(seed, fmt.Sprintf("tail/%d/%d", rec.Timestamp, i), tail))
		}
		out := max(rec.OutputLength, 1)
		if p.MaxOutput > 0 {
			out = min(out, p.MaxOutput)
		}
		at := time.Duration(float64(time.Duration(rec.Timestamp-start)*time.Millisecond) / speed)
		reqs = append(reqs, Request{
			At: at, Key: fmt.Sprintf("trace/%d", i),
			Messages:  []Message{{Role: "user", Content: b.String()}},
			MaxTokens: out,
		})
	}
	return finish(name, reqs)
}

func appendWords(b *strings.Builder, s string) {
	if s == "" {
		return
	}
	if b.Len() > 0 {
		b.WriteByte(' ')
	}
	b.WriteString(s)
}

// firstWords returns the first n space-separated words of s.
func firstWords(s string, n int) string {
	for i := 0; i < len(s); i++ {
		if s[i] == ' ' {
			n--
			if n == 0 {
				return s[:i]
			}
		}
	}
	return s
}
