package kvevents

import "testing"

// BenchmarkDecodeBlockStored decodes batches of 32 BlockStored events, one
// 16-token block each (Qwen-sized token ids, uint64 hashes, a parent), the
// shape vLLM publishes per scheduler step, into a reused Batch.
func BenchmarkDecodeBlockStored(b *testing.B) {
	const perBatch = 32
	batch := Batch{TS: exampleTS, DPRank: 0}
	for i := range perBatch {
		batch.Events = append(batch.Events, Event{Kind: KindBlockStored,
			BlockHashes: []uint64{exampleHash ^ uint64(i)}, HasParent: true, ParentHash: uint64(i) << 48,
			TokenIDs: exampleTokens, BlockSize: 16, Medium: "GPU", ExtraKeys: []byte{0x91, 0xc0},
			HasGroupIdx: true, SpecKind: "full_attention"})
	}
	for _, f := range []Format{FormatVLLMMap, FormatVLLMArray, FormatSGLang} {
		payload := AppendBatch(nil, &batch, f)
		b.Run(f.String(), func(b *testing.B) {
			var into Batch
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				if err := DecodeBatch(payload, &into); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*perBatch)/b.Elapsed().Seconds(), "events/s")
			b.ReportMetric(float64(testing.AllocsPerRun(10, func() { _ = DecodeBatch(payload, &into) }))/perBatch, "allocs/event")
		})
	}
}

// BenchmarkAppendBatch is the publisher's encoding cost for the same batch.
func BenchmarkAppendBatch(b *testing.B) {
	batch := Batch{TS: exampleTS, DPRank: 0}
	for i := range 32 {
		batch.Events = append(batch.Events, Event{Kind: KindBlockStored, BlockHashes: []uint64{uint64(i)},
			TokenIDs: exampleTokens, BlockSize: 16, Medium: "GPU"})
	}
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		buf = AppendBatch(buf[:0], &batch, FormatVLLMMap)
	}
	b.ReportMetric(float64(b.N*32)/b.Elapsed().Seconds(), "events/s")
}
