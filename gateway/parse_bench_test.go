package gateway

import "testing"

// BenchmarkParseChat4KB times validating and decoding a 4 KB chat body.
func BenchmarkParseChat4KB(b *testing.B) {
	body := chatPrompt(1, 2)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := parseRequest(body, kindChat); err != nil {
			b.Fatal(err)
		}
	}
}
