package workload

import (
	"math/rand/v2"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// vocab is a fixed list of lowercase pseudo-words. Every word is letters
// only, so the builtin tokenizer turns "w1 w2 ... wn" into exactly n tokens
// (the first word alone, each later one with its leading space).
var vocab = func() []string {
	rng := rand.New(rand.NewPCG(0x6b766d657368, 0x776f726473))
	const letters = "abcdefghijklmnopqrstuvwxyz"
	seen := map[string]bool{}
	words := make([]string, 0, 4096)
	for len(words) < cap(words) {
		n := 3 + rng.IntN(7)
		var b strings.Builder
		for range n {
			b.WriteByte(letters[rng.IntN(len(letters))])
		}
		if w := b.String(); !seen[w] {
			seen[w] = true
			words = append(words, w)
		}
	}
	return words
}()

// streamRNG returns the random source for one named piece of text, so the
// same (seed, name) always yields the same words no matter what else a
// scenario generates or in which order.
func streamRNG(seed uint64, name string) *rand.Rand {
	return rand.New(rand.NewPCG(seed, xxhash.Sum64String(name)))
}

// Words returns n space-separated pseudo-words drawn from the stream named
// name: exactly n builtin tokens when it follows a newline or starts a text.
func Words(seed uint64, name string, n int) string {
	if n <= 0 {
		return ""
	}
	rng := streamRNG(seed, name)
	var b strings.Builder
	b.Grow(n * 7)
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(vocab[rng.IntN(len(vocab))])
	}
	return b.String()
}
