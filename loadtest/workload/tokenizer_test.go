package workload

import (
	"slices"
	"testing"
	"time"
)

// sameAsTokenize checks that a Tokenizer over reqs gives Tokenize's ids for
// every distinct prompt, tokenized once each in order, and returns how
// many prompts it checked.
func sameAsTokenize(t *testing.T, reqs []Request) int {
	t.Helper()
	tok := NewTokenizer(reqs)
	seen := map[string]bool{}
	for i := range reqs {
		if seen[reqs[i].Key] {
			continue
		}
		seen[reqs[i].Key] = true
		want, werr := Tokenize(reqs[i].Messages)
		got, gerr := tok.Tokenize(reqs[i].Messages)
		if (werr != nil) != (gerr != nil) || !slices.Equal(got, want) {
			t.Fatalf("%s: Tokenizer gave %d ids (%v), Tokenize %d (%v)", reqs[i].Key, len(got), gerr, len(want), werr)
		}
	}
	if len(tok.ids) != 0 || len(tok.left) != 0 {
		t.Fatalf("after every prompt the tokenizer still holds %d messages' ids, %d counts", len(tok.ids), len(tok.left))
	}
	return len(seen)
}

func TestTokenizerMatchesTokenizeOnTheScenarios(t *testing.T) {
	tenants, err := Tenants("tenants", tenantsParams(), 3, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	multiturn, err := Multiturn(multiturnParams(), 3, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	nocache, err := NoCache(NoCacheParams{Rate: 5, InputMedian: 200, OutputMedian: 4, MaxInput: 400, MaxOutput: 8}, 3, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []Workload{tenants, multiturn, nocache} {
		if n := sameAsTokenize(t, w.Requests); n < 10 {
			t.Fatalf("%s: only %d prompts", w.Scenario, n)
		}
	}
}

// Messages whose text ends or starts in whitespace, punctuation or
// template-like markup still split at their boundaries.
func TestTokenizerMatchesTokenizeAtAwkwardBoundaries(t *testing.T) {
	shared := []Message{{Role: "system", Content: "ends in a space "}, {Role: "user", Content: "ends in newlines\n\n"}}
	var reqs []Request
	for i, tail := range []string{"", " ", "\n", "<|assistant|>", " <|x", "héllo wörld ", "\t\r\n ", "\xff bad utf-8", "1 2 3"} {
		msgs := append(slices.Clone(shared), Message{Role: "user", Content: tail}, Message{Role: "assistant", Content: tail + tail})
		reqs = append(reqs, Request{Key: string(rune('a' + i)), Messages: msgs})
	}
	reqs = append(reqs, Request{Key: "empty"}, Request{Key: "a", Messages: reqs[0].Messages})
	sameAsTokenize(t, reqs)
}

func FuzzTokenizerMatchesTokenize(f *testing.F) {
	f.Add("system", "you are kind ", "user", "hi\n", "a <|b|> c")
	f.Fuzz(func(t *testing.T, r1, c1, r2, c2, c3 string) {
		shared := Message{Role: r1, Content: c1}
		reqs := []Request{
			{Key: "x", Messages: []Message{shared, {Role: r2, Content: c2}}},
			{Key: "y", Messages: []Message{shared, {Role: r2, Content: c3}, {Role: r1, Content: c2}}},
			{Key: "z", Messages: []Message{{Role: r2, Content: c3}}},
		}
		sameAsTokenize(t, reqs)
	})
}

// BenchmarkTokenizeTenants tokenizes a tenants workload's distinct prompts
// (each group's context shared by five users' questions) each whole, with
// Tokenize, and through a Tokenizer.
func BenchmarkTokenizeTenants(b *testing.B) {
	w, err := Tenants("tenants", TenantsParams{Groups: 16, UsersPerGroup: 5, ContextTokens: 6000, QuestionTokens: 1200,
		OutputTokens: 10, RateStart: 20, RateEnd: 20}, 1, 20*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	var distinct []Request
	seen := map[string]bool{}
	for _, r := range w.Requests {
		if !seen[r.Key] {
			seen[r.Key] = true
			distinct = append(distinct, r)
		}
	}
	b.Run("each", func(b *testing.B) {
		for b.Loop() {
			for i := range distinct {
				if _, err := Tokenize(distinct[i].Messages); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	b.Run("tokenizer", func(b *testing.B) {
		for b.Loop() {
			tok := NewTokenizer(distinct)
			for i := range distinct {
				if _, err := tok.Tokenize(distinct[i].Messages); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}
