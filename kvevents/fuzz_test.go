package kvevents

import (
	"math/rand/v2"
	"testing"
)

// FuzzDecodeBatch: decoding never panics, and whatever decodes survives a
// re-encode in every format (up to what that format carries) unchanged.
func FuzzDecodeBatch(f *testing.F) {
	f.Add(exampleMapWire)
	f.Add(exampleArrayWire)
	rng := rand.New(rand.NewPCG(3, 4))
	for range 20 {
		b := randomBatch(rng)
		for _, fm := range []Format{FormatVLLMMap, FormatVLLMArray, FormatSGLang} {
			f.Add(AppendBatch(nil, &b, fm))
		}
	}
	f.Add(wire(hx("83 a2"), "ts", hx("cb 4000000000000000"), hx("a6"), "events", hx("91 91 b0"), "AllBlocksCleared",
		hx("ac"), "attn_dp_rank", hx("03")))
	f.Fuzz(func(t *testing.T, payload []byte) {
		var b Batch
		if err := DecodeBatch(payload, &b); err != nil {
			return
		}
		for _, fm := range []Format{FormatVLLMMap, FormatVLLMArray, FormatSGLang} {
			again := AppendBatch(nil, &b, fm)
			var got Batch
			if err := DecodeBatch(again, &got); err != nil {
				t.Fatalf("%v: re-encoded batch does not decode: %v\n%x", fm, err, again)
			}
			want := projected(&b, fm)
			if !batchEqual(&got, &want) {
				t.Fatalf("%v: round trip changed the batch:\n got %+v\nwant %+v", fm, got, want)
			}
		}
	})
}
