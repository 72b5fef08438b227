package plan

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

// maxBodyBytes is the router's --max-body-bytes default (cmd/router): the
// largest body a client can make the router decide on.
const maxBodyBytes = 64 << 20

// salad returns about n bytes of words, deterministic in seed.
func salad(seed uint64, n int) string {
	words := strings.Fields("the of and to in is you that it was for on are as with they at be this have from or one had by word but not what all were we when your can said there use each which she do how their if will up other about out many then them these so some her would make like him into time has look two more write go see number no way could people my than first water been call who oil its now find long down day did get come made may part")
	r := rand.New(rand.NewPCG(seed, 11))
	var sb strings.Builder
	sb.Grow(n + 16)
	for sb.Len() < n {
		sb.WriteString(words[r.IntN(len(words))])
		sb.WriteByte(' ')
	}
	return sb.String()
}

// maxBodies are the three shapes of a body of about n bytes that cost a
// decision the most: one prompt string, one chat message, and as many
// one-word messages as fit.
func maxBodies(n int) []struct {
	name string
	kind request.Kind
	body []byte
} {
	quoted, _ := json.Marshal(salad(99, n-128))
	prompt := append(append([]byte(`{"model":"sim","prompt":`), quoted...), '}')
	message := append(append([]byte(`{"model":"sim","messages":[{"role":"user","content":`), quoted...), `}]}`...)
	tiny := []byte(`{"role":"user","content":"word"},`)
	messages := append(make([]byte, 0, n), `{"model":"sim","messages":[`...)
	for len(messages)+len(tiny)+2 <= n {
		messages = append(messages, tiny...)
	}
	messages = append(messages[:len(messages)-1], `]}`...)
	return []struct {
		name string
		kind request.Kind
		body []byte
	}{
		{"prompt", request.Completion, prompt},
		{"message", request.Chat, message},
		{"messages", request.Chat, messages},
	}
}

// maxBodyTokenizers are the builtin tokenizer and, where
// ../shared/tokenizers has them, Llama-3's and Qwen2.5's.
func maxBodyTokenizers(tb testing.TB) map[string]tokenize.Model {
	out := map[string]tokenize.Model{"builtin": tokenize.Builtin{}}
	for _, name := range []string{"llama3", "qwen2.5"} {
		if tk := realTokenizer(tb, name); tk != nil {
			out[name] = tk
		}
	}
	return out
}

// realTokenizers holds the tokenizers loaded from ../shared/tokenizers,
// shared by the tests (loading one takes a good part of a second).
var realTokenizers struct {
	sync.Mutex
	m map[string]tokenize.Model
}

// realTokenizer returns the named tokenizer of ../shared/tokenizers, nil
// when its files are not there.
func realTokenizer(tb testing.TB, name string) tokenize.Model {
	realTokenizers.Lock()
	defer realTokenizers.Unlock()
	if tk, ok := realTokenizers.m[name]; ok {
		return tk
	}
	var tk tokenize.Model
	dir := filepath.Join("..", "..", "shared", "tokenizers", name)
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err == nil {
		hf, err := tokenize.LoadDir(dir)
		if err != nil {
			tb.Fatal(err)
		}
		tk = hf
	}
	if realTokenizers.m == nil {
		realTokenizers.m = map[string]tokenize.Model{}
	}
	realTokenizers.m[name] = tk
	return tk
}

// bigFleet is an Input over 50 prefix-aware replicas for tk's model.
func bigFleet(tb testing.TB, tk tokenize.Model) Input {
	reps := make([]replica, 50)
	for i := range reps {
		reps[i] = replica{name: fmt.Sprintf("replica-%02d", i), filter: true, waiting: i % 3}
	}
	snap := fleetOf(tb, reps, nil)
	policy, _ := routing.New("kvaware", routing.Config{})
	return Input{Snapshot: snap, Loads: make([]Load, len(snap.Replicas)), Model: model, Now: t0,
		ModelSettings: Model{Tokenizer: tk},
		Settings:      Settings{Policy: policy, MaxPrefixTokens: tokenize.DefaultMaxPrefixTokens, MaxPrefixBytes: tokenize.DefaultMaxPrefixBytes, MaxAttempts: 3}}
}

// TestDecisionBoundedOnHugeBodies: deciding on the largest bodies of each
// shape (one prompt, one message, as many messages as fit) allocates a few
// MB whatever the body's size, as only max_prefix_bytes of the prompt are
// rendered and tokenized, and still matches max_prefix_tokens tokens while
// counting the whole prompt roughly.
func TestDecisionBoundedOnHugeBodies(t *testing.T) {
	if raceEnabled {
		t.Skip("tokenizes 16 MB bodies: minutes under the race detector, and one goroutine")
	}
	const size = 16 << 20
	bodies := maxBodies(size)
	for name, tk := range maxBodyTokenizers(t) {
		in := bigFleet(t, tk)
		for _, shape := range bodies {
			req, err := request.Parse(shape.body, shape.kind)
			if err != nil {
				t.Fatal(err)
			}
			in.Request = req
			var p Plan
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			if err := p.Decide(&in); err != nil {
				t.Fatal(err)
			}
			runtime.ReadMemStats(&after)
			if allocated := after.TotalAlloc - before.TotalAlloc; allocated > 8<<20 {
				t.Errorf("%s/%s: the decision allocated %d MB", name, shape.name, allocated>>20)
			}
			// A token takes 2 to 8 bytes of these bodies.
			if pr := p.Prompt; pr.Err != nil || !pr.Estimated || len(pr.IDs) != in.Settings.MaxPrefixTokens ||
				pr.Tokens < size/8 || pr.Tokens > size/2 {
				t.Errorf("%s/%s: %d ids, %d prompt tokens (estimated %v), %v", name, shape.name, len(pr.IDs), pr.Tokens, pr.Estimated, pr.Err)
			}
		}
	}
}

// BenchmarkDecisionMaxBody times the decision on the largest bodies the
// size limit lets through (maxBodies), parse reported apart: it must stay
// within a few milliseconds whatever the body, as only the first
// max_prefix_tokens tokens are matched. Run with -benchtime=3x.
func BenchmarkDecisionMaxBody(b *testing.B) {
	bodies := maxBodies(maxBodyBytes)
	for name, tk := range maxBodyTokenizers(b) {
		in := bigFleet(b, tk)
		for _, shape := range bodies {
			b.Run(name+"/"+shape.name, func(b *testing.B) {
				var parse, decide time.Duration
				var p Plan
				for b.Loop() {
					t0 := time.Now()
					req, err := request.Parse(shape.body, shape.kind)
					if err != nil {
						b.Fatal(err)
					}
					t1 := time.Now()
					in.Request = req
					if err := p.Decide(&in); err != nil {
						b.Fatal(err)
					}
					decide += time.Since(t1)
					parse += t1.Sub(t0)
					if pr := p.Prompt; pr.Err != nil || pr.Tokens < in.Settings.MaxPrefixTokens {
						b.Fatalf("tokens %d err %v", pr.Tokens, pr.Err)
					}
				}
				b.ReportMetric(float64(decide.Microseconds())/float64(b.N)/1e3, "decide-ms/op")
				b.ReportMetric(float64(parse.Microseconds())/float64(b.N)/1e3, "parse-ms/op")
			})
		}
	}
}
