package request

import (
	"encoding/json"
	"strings"
	"testing"
)

// BenchmarkParseChat4KB times validating and decoding a 4 KB chat body.
func BenchmarkParseChat4KB(b *testing.B) {
	body, _ := json.Marshal(map[string]any{
		"model": "llama",
		"messages": []map[string]string{
			{"role": "system", "content": strings.Repeat("the system prompt says ", 3584/23)},
			{"role": "user", "content": strings.Repeat("a user turn ", 512/12)},
		},
	})
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse(body, Chat); err != nil {
			b.Fatal(err)
		}
	}
}
