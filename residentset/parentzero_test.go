package residentset

import (
	"encoding/hex"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/kvevents"
)

func hexBytes(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Parent 0 is "no parent" (llm-d's inference simulator sends it so, in
// vLLM's array layout) unless a block hashed 0 is resident. Exact bytes,
// both layouts: block 5 (tokens 1–4) stored with parent 0, then block 6
// (tokens 5–8) chained on it.
func TestParentZeroIsNoParent(t *testing.T) {
	for _, tc := range []struct{ name, first, second string }{
		{"array",
			// [ts 1.0, [["BlockStored", [5], 0, [1,2,3,4], 4, nil, "GPU"]]]
			"92 cb3ff0000000000000 91 97 ab" + hex.EncodeToString([]byte("BlockStored")) + " 9105 00 9401020304 04 c0 a3" + hex.EncodeToString([]byte("GPU")),
			"92 cb3ff0000000000000 91 97 ab" + hex.EncodeToString([]byte("BlockStored")) + " 9106 05 9405060708 04 c0 a3" + hex.EncodeToString([]byte("GPU"))},
		{"map",
			// [ts 1.0, [{type: BlockStored, block_hashes: [5], parent_block_hash: 0, token_ids: [1,2,3,4], block_size: 4}]]
			"92 cb3ff0000000000000 91 85 a4" + hex.EncodeToString([]byte("type")) + " ab" + hex.EncodeToString([]byte("BlockStored")) +
				" ac" + hex.EncodeToString([]byte("block_hashes")) + " 9105 b1" + hex.EncodeToString([]byte("parent_block_hash")) + " 00" +
				" a9" + hex.EncodeToString([]byte("token_ids")) + " 9401020304 aa" + hex.EncodeToString([]byte("block_size")) + " 04",
			"92 cb3ff0000000000000 91 85 a4" + hex.EncodeToString([]byte("type")) + " ab" + hex.EncodeToString([]byte("BlockStored")) +
				" ac" + hex.EncodeToString([]byte("block_hashes")) + " 9106 b1" + hex.EncodeToString([]byte("parent_block_hash")) + " 05" +
				" a9" + hex.EncodeToString([]byte("token_ids")) + " 9405060708 aa" + hex.EncodeToString([]byte("block_size")) + " 04"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, rec := New(Options{}), newRecorder(t)
			var b kvevents.Batch
			for _, w := range []string{tc.first, tc.second} {
				if err := kvevents.DecodeBatch(hexBytes(t, w), &b); err != nil {
					t.Fatal(err)
				}
				if ev := &b.Events[0]; !ev.HasParent {
					t.Fatalf("decoded without a parent: %+v", ev)
				}
				s.Apply(&b.Events[0], rec)
			}
			wantSet(t, s, rec, routerKeys(seq(1, 8))...)
			if st := s.Stats(); st.Orphans != 0 {
				t.Fatalf("%d orphans", st.Orphans)
			}
		})
	}
}

// With a block hashed 0 resident, parent 0 is that block.
func TestParentZeroNamesAResidentBlockZero(t *testing.T) {
	s, rec := New(Options{}), newRecorder(t)
	s.Apply(stored([]uint64{0}, nil, seq(1, 4)), rec)
	s.Apply(stored([]uint64{7}, ptr(0), seq(5, 4)), rec)
	wantSet(t, s, rec, routerKeys(seq(1, 8))...)
	// Without it, the same event starts a prefix of its own.
	s2, rec2 := New(Options{}), newRecorder(t)
	s2.Apply(stored([]uint64{7}, ptr(0), seq(5, 4)), rec2)
	wantSet(t, s2, rec2, routerKeys(seq(5, 4))...)
}
