package tokenize

import (
	"encoding/json"
	"fmt"
	"html"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	proseOnce sync.Once
	proseText string
)

// prose returns a few hundred KB of English prose built at test time from
// the Go distribution's documentation (HTML tags stripped), so no large
// file lives in the repository.
func prose(tb testing.TB) string {
	proseOnce.Do(func() {
		goroot := runtime.GOROOT()
		var files []string
		for _, pat := range []string{"doc/*.html", "doc/*.md", "*.md", "LICENSE", "src/runtime/HACKING.md"} {
			m, _ := filepath.Glob(filepath.Join(goroot, pat))
			files = append(files, m...)
		}
		tags := regexp.MustCompile(`(?s)<[^>]*>`)
		var b strings.Builder
		for _, f := range files {
			data, err := os.ReadFile(f)
			if err != nil {
				continue
			}
			b.WriteString(html.UnescapeString(tags.ReplaceAllString(string(data), "")))
			b.WriteString("\n\n")
		}
		proseText = b.String()
	})
	if len(proseText) < 100<<10 {
		tb.Skipf("only %d bytes of prose under GOROOT %s", len(proseText), runtime.GOROOT())
	}
	return proseText
}

// BenchmarkEncodeProse measures encoding English prose on one goroutine.
// "cold" starts every iteration with every cache empty (as a freshly
// loaded tokenizer); "warm-pieces" keeps the piece caches across
// iterations. The segment cache stays off in both, so every byte is split.
func BenchmarkEncodeProse(b *testing.B) {
	text := prose(b)
	for _, model := range []string{"llama3", "qwen2.5", "gpt2", "llama2"} {
		for _, mode := range []string{"cold", "warm-pieces", "regexp2"} {
			if mode == "regexp2" && model == "llama2" {
				continue
			}
			b.Run(model+"/"+mode, func(b *testing.B) {
				opts := []Option{WithSegmentCacheBytes(0)}
				variant := "nosegcache"
				if mode == "regexp2" {
					opts = append(opts, func(o *options) { o.regexOnly = true })
					variant = "nosegcache-regexp2"
				}
				tok, _ := goldenVariant(b, model, variant, opts...)
				dst := make([]uint32, 0, len(text))
				b.SetBytes(int64(len(text)))
				b.ResetTimer()
				cpu := processCPU()
				for b.Loop() {
					if mode != "warm-pieces" {
						tok.resetCaches()
					}
					var err error
					if dst, err = tok.AppendEncode(dst[:0], text, false); err != nil {
						b.Fatal(err)
					}
				}
				reportCPUThroughput(b, cpu, len(text))
				b.ReportMetric(float64(len(dst)), "tokens")
			})
		}
	}
}

// processCPU is the CPU time this process has used. The benchmark machine
// is shared, so wall-clock MB/s understates what one core does; cpu-MB/s
// divides the bytes by the CPU time actually spent (GC included).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func reportCPUThroughput(b *testing.B, start time.Duration, bytesPerOp int) {
	if used := processCPU() - start; used > 0 {
		b.ReportMetric(float64(bytesPerOp)*float64(b.N)/used.Seconds()/1e6, "cpu-MB/s")
	}
}

// BenchmarkSegmentCacheHit re-encodes a chat-shaped prompt whose segments
// are all cached: the cost of a hit, which must not allocate.
func BenchmarkSegmentCacheHit(b *testing.B) {
	tok, _ := goldenTokenizer(b, "llama3")
	text := prose(b)[:4096]
	prompt := "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n" + text + "<|eot_id|>"
	dst, err := tok.AppendEncode(nil, prompt, false)
	if err != nil {
		b.Fatal(err)
	}
	want := slices.Clone(dst)
	b.SetBytes(int64(len(prompt)))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		dst, _ = tok.AppendEncode(dst[:0], prompt, false)
	}
	b.StopTimer()
	if !slices.Equal(dst, want) {
		b.Fatal("cached ids differ")
	}
}

// multiTurnChat builds a Llama-3 chat of about n tokens of turns.
func multiTurnChat(b testing.TB, turns int) json.RawMessage {
	text := prose(b)
	var msgs []map[string]string
	msgs = append(msgs, map[string]string{"role": "system", "content": "You are a helpful assistant."})
	off := 0
	for k := 0; k < turns; k++ {
		n := 2000 + 37*k
		role := "user"
		if k%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, map[string]string{"role": role, "content": text[off : off+n]})
		off += n
	}
	raw, _ := json.Marshal(msgs)
	return raw
}

// BenchmarkMultiTurnChatCached renders and tokenizes a ~32k-token Llama-3
// chat whose earlier turns were seen before; every iteration ends with a
// new user turn, so only that turn is tokenized afresh.
func BenchmarkMultiTurnChatCached(b *testing.B) {
	tok, _ := goldenTokenizer(b, "llama3")
	const turns = 48
	full := multiTurnChat(b, turns)
	var msgs []json.RawMessage
	if err := json.Unmarshal(full, &msgs); err != nil {
		b.Fatal(err)
	}
	earlier, _ := json.Marshal(msgs[:len(msgs)-1])
	lastTurn := prose(b)[200000:202000]
	withTurn := func(n int) json.RawMessage {
		content, _ := json.Marshal(fmt.Sprintf("Question %d: %s", n, lastTurn))
		return json.RawMessage(string(earlier[:len(earlier)-1]) + `,{"role":"user","content":` + string(content) + `}]`)
	}
	prompt, ids, err := tok.EncodeChat(Chat{Messages: withTurn(-1), AddGenerationPrompt: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Run("render+encode", func(b *testing.B) {
		b.ReportAllocs()
		n := 0
		for b.Loop() {
			n++
			if _, _, err := tok.EncodeChat(Chat{Messages: withTurn(n), AddGenerationPrompt: true}); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(len(ids)), "tokens")
	})
	// The tokenizer's share: the rendered prompt with a new last turn.
	b.Run("encode", func(b *testing.B) {
		b.ReportAllocs()
		dst := make([]uint32, 0, 2*len(ids))
		n := 0
		for b.Loop() {
			n++
			p := strings.Replace(prompt, "Question -1:", fmt.Sprintf("Question %d:", n), 1)
			dst, _ = tok.AppendEncode(dst[:0], p, false)
		}
		b.ReportMetric(float64(len(ids)), "tokens")
	})
}

// TestLlama3HeapSize loads the Llama-3 tokenizer and measures the heap it
// keeps (the bound: 100 MB).
func TestLlama3HeapSize(t *testing.T) {
	dir := filepath.Join(sharedTokenizers(t), "llama3")
	var before, after runtime.MemStats
	// Two collections: a tokenizer dropped earlier may still be reachable
	// through sync.Pool's victim cache for one more cycle.
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&before)
	tok, err := LoadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&after)
	heap := float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / (1 << 20)
	t.Logf("loaded Llama-3 tokenizer keeps %.1f MB of heap", heap)
	if heap > 100 {
		t.Errorf("Llama-3 tokenizer keeps %.1f MB of heap, want <= 100", heap)
	}
	if _, err := tok.Encode("hello", true); err != nil {
		t.Fatal(err)
	}
	runtime.KeepAlive(tok)
}

func TestSegmentCacheHitDoesNotAllocate(t *testing.T) {
	tok, _ := goldenTokenizer(t, "llama3")
	prompt := "<|start_header_id|>user<|end_header_id|>\n\nThe quick brown fox jumps over the lazy dog, twice.<|eot_id|>"
	dst, err := tok.AppendEncode(nil, prompt, true)
	if err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(100, func() {
		dst, _ = tok.AppendEncode(dst[:0], prompt, true)
	})
	if allocs != 0 && !raceEnabled {
		t.Fatalf("cached encode allocates %.1f times per run", allocs)
	}
	runtime.KeepAlive(dst)
}

// BenchmarkSplit compares the hand-written Llama-3 scanner with regexp2
// running the same pattern (the split step alone).
func BenchmarkSplit(b *testing.B) {
	text := prose(b)
	for _, p := range scannerPatterns {
		for _, impl := range []string{"scanner", "regexp2"} {
			b.Run(p.name+"/"+impl, func(b *testing.B) {
				var pat pattern = scanPattern{scannerFor(p.src)}
				if impl == "regexp2" {
					pat = scannerRegexps[p.src]
				}
				var spans []span
				b.SetBytes(int64(len(text)))
				cpu := processCPU()
				for b.Loop() {
					spans, _ = pat.spans(text, spans[:0])
				}
				reportCPUThroughput(b, cpu, len(text))
			})
		}
	}
}
