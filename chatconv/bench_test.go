package chatconv

import "testing"

// BenchmarkConvert converts the agent testdata bodies, the shape of the
// traffic these APIs carry.
func BenchmarkConvert(b *testing.B) {
	for _, c := range []struct {
		name, prefix string
	}{{"responses", "responses_agent"}, {"messages", "messages_agent"}} {
		body := []byte(loadCases(b, c.prefix[:len(c.name)])[c.prefix].Body)
		conv := converter(c.name)
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := conv(body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
