package residentset

import (
	"strconv"
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/vmihailenco/msgpack/v5"
)

func extra(t testing.TB, perBlock ...any) []byte {
	b, err := msgpack.Marshal(perBlock)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestExtraKeys(t *testing.T) {
	tokens := seq(1, 12) // 3 blocks of 4
	base := blockkey.Append(nil, blockkey.Seed("", ""), tokens, 4)

	t.Run("text only", func(t *testing.T) {
		s, rec := New(Options{}), newRecorder(t)
		ev := stored([]uint64{1, 2, 3}, nil, tokens)
		ev.ExtraKeys = extra(t, nil, nil, nil)
		s.Apply(ev, rec)
		wantSet(t, s, rec, base...)
	})
	t.Run("lora name and salt", func(t *testing.T) {
		s, rec := New(Options{}), newRecorder(t)
		ev := stored([]uint64{1, 2}, nil, tokens[:8])
		ev.LoRAName = "sql"
		ev.ExtraKeys = extra(t, []any{"sql", "tenant-7"}, []any{"sql"})
		s.Apply(ev, rec)
		wantSet(t, s, rec, blockkey.Append(nil, blockkey.Seed("sql", "tenant-7"), tokens[:8], 4)...)
		old := stored([]uint64{5}, nil, tokens[:4]) // older vLLM: lora_int_id
		old.LoRAID = 3
		old.ExtraKeys = extra(t, []any{3})
		s.Apply(old, rec)
		if !s.Contains(blockkey.Next(blockkey.Seed("3", ""), tokens[:4])) {
			t.Fatal("block with lora_int_id extra key not keyed")
		}
		for _, id := range []int64{200, 70000, 1 << 40, -5} { // every msgpack int width
			wide := stored([]uint64{uint64(10 + id&0xff)}, nil, tokens[4:8])
			wide.LoRAID = id
			wide.ExtraKeys = extra(t, []any{id})
			s.Apply(wide, rec)
			if !s.Contains(blockkey.Next(blockkey.Seed(strconv.FormatInt(id, 10), ""), tokens[4:8])) {
				t.Fatalf("block with lora_int_id %d not keyed", id)
			}
		}
	})
	t.Run("sglang salt field", func(t *testing.T) {
		s, rec := New(Options{}), newRecorder(t)
		ev := stored([]uint64{1}, nil, tokens[:4])
		ev.CacheSalt = "s"
		s.Apply(ev, rec)
		wantSet(t, s, rec, blockkey.Next(blockkey.Seed("", "s"), tokens[:4]))
	})
	t.Run("image", func(t *testing.T) {
		s, rec := New(Options{}), newRecorder(t)
		ev := stored([]uint64{1, 2, 3}, nil, tokens)
		ev.ExtraKeys = extra(t, nil, []any{[]any{"img-sha", 2}}, []any{[]any{"img-sha", -2}})
		s.Apply(ev, rec)
		wantSet(t, s, rec, base[0])
		// A child of the image block is keyless too, not an orphan.
		child := stored([]uint64{4}, ptr(3), seq(50, 4))
		s.Apply(child, rec)
		s.Apply(removed(2, 3, 4), rec)
		wantSet(t, s, rec, base[0])
		st := s.Stats()
		if st.ExtraKeyed != 2 || st.KeylessDescendants != 1 || st.Orphans != 0 || st.UnknownRemovals != 0 {
			t.Fatalf("stats %+v: want 2 extra-keyed, 1 keyless descendant, no orphans or unknown removals", st)
		}
	})
	t.Run("garbage", func(t *testing.T) {
		s, rec := New(Options{}), newRecorder(t)
		ev := stored([]uint64{1, 2}, nil, tokens[:8])
		ev.ExtraKeys = []byte{0x92, 0xc1, 0xff}
		s.Apply(ev, rec)
		wantSet(t, s, rec)
		// An array claiming 2^31 elements must not allocate them.
		ev.ExtraKeys = []byte{0xdd, 0x7f, 0xff, 0xff, 0xff, 0xc0}
		s.Apply(ev, rec)
		wantSet(t, s, rec)
	})
}

func FuzzExtraKeys(f *testing.F) {
	f.Add(extra(f, nil, nil))
	f.Add(extra(f, []any{"a", "salt"}, []any{[]any{"img", 1}}))
	f.Add([]byte{0xdc, 0, 2, 0xc0, 0xc0})
	f.Fuzz(func(t *testing.T, raw []byte) {
		s := New(Options{})
		ev := stored([]uint64{1, 2}, nil, seq(0, 8))
		ev.LoRAName, ev.LoRAID, ev.ExtraKeys = "a", 1, raw
		s.Apply(ev, nil)
		if s.Len() > 2 {
			t.Fatalf("%d keys from 2 blocks", s.Len())
		}
	})
}
