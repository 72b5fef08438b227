package bloom

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"slices"
	"sort"
	"testing"
)

func TestDeltaGoldenBytes(t *testing.T) {
	d := Delta{Epoch: 0x0102030405060708, Generation: 2, Seq: 3, Keys: []uint64{0xaabbccddeeff0011, 1}}
	got := hex.EncodeToString(d.AppendBinary(nil))
	want := "4b420102" + "0807060504030201" + "0200000000000000" + "0300000000000000" + "02000000" +
		"1100ffeeddccbbaa" + "0100000000000000"
	if got != want {
		t.Fatalf("delta encodes as\n%s, want\n%s", got, want)
	}
	if len(got)/2 != DeltaSize(2) {
		t.Fatalf("DeltaSize(2) = %d, encoding has %d bytes", DeltaSize(2), len(got)/2)
	}
	back, err := DecodeDelta(d.AppendBinary(nil))
	if err != nil || back.Epoch != d.Epoch || back.Generation != 2 || back.Seq != 3 || !slices.Equal(back.Keys, d.Keys) {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
}

func TestSnapshotGoldenHeaderAndRoundTrip(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: 100}, 5, t0)
	g.Add(0x7132c13eb4fd2630)
	g.TakeDelta()
	s := g.Snapshot()
	b := s.AppendBinary([]byte("prefix"))[len("prefix"):]
	wantHeader := "4b420101" + "07000000" + "0500000000000000" + "0100000000000000" + "0100000000000000" +
		"0004000000000000" + "0100000000000000"
	if got := hex.EncodeToString(b[:snapshotHeaderLen]); got != wantHeader {
		t.Fatalf("snapshot header\n%s, want\n%s", got, wantHeader)
	}
	if len(b) != SnapshotSize(s.M) || len(b) != 48+1024/8 {
		t.Fatalf("snapshot of m=%d is %d bytes, SnapshotSize says %d", s.M, len(b), SnapshotSize(s.M))
	}
	back, err := DecodeSnapshot(b)
	if err != nil {
		t.Fatal(err)
	}
	if back.Epoch != 5 || back.Generation != 1 || back.Seq != 1 || back.Keys != 1 || back.M != s.M || back.K != s.K || !slices.Equal(back.Words, s.Words) {
		t.Fatalf("round trip differs: %+v", back)
	}
}

func TestDecodeErrors(t *testing.T) {
	s := NewGenerations(GenerationConfig{Capacity: 100}, 5, t0).Snapshot()
	good := s.AppendBinary(nil)
	d := Delta{Epoch: 1, Generation: 1, Seq: 1, Keys: []uint64{1, 2}}
	goodDelta := d.AppendBinary(nil)
	mod := func(b []byte, f func([]byte)) []byte { c := slices.Clone(b); f(c); return c }
	for _, c := range []struct {
		name string
		b    []byte
		want error
	}{
		{"empty", nil, ErrShort},
		{"magic", mod(good, func(b []byte) { b[0] = 'X' }), ErrMagic},
		{"version", mod(good, func(b []byte) { b[2] = 2 }), ErrVersion},
		{"delta as snapshot", goodDelta, ErrKind},
		{"short header", good[:20], ErrShort},
		{"k=0", mod(good, func(b []byte) { b[4] = 0 }), ErrGeometry},
		{"k too big", mod(good, func(b []byte) { b[4] = MaxK + 1 }), ErrGeometry},
		{"reserved", mod(good, func(b []byte) { b[6] = 1 }), ErrGeometry},
		{"m not blocks", mod(good, func(b []byte) { binary.LittleEndian.PutUint64(b[32:], 1000) }), ErrGeometry},
		{"m huge", mod(good, func(b []byte) { binary.LittleEndian.PutUint64(b[32:], 1<<62) }), ErrGeometry},
		{"words short", good[:len(good)-8], ErrLength},
		{"trailing", append(slices.Clone(good), 0), ErrLength},
	} {
		if _, err := DecodeSnapshot(c.b); !errors.Is(err, c.want) {
			t.Errorf("%s: DecodeSnapshot error %v, want %v", c.name, err, c.want)
		}
	}
	for _, c := range []struct {
		name string
		b    []byte
		want error
	}{
		{"snapshot as delta", good, ErrKind},
		{"short", goodDelta[:30], ErrShort},
		{"count too big", mod(goodDelta, func(b []byte) { binary.LittleEndian.PutUint32(b[28:], 0xffffffff) }), ErrLength},
		{"key cut", goodDelta[:len(goodDelta)-1], ErrLength},
	} {
		if _, err := DecodeDelta(c.b); !errors.Is(err, c.want) {
			t.Errorf("%s: DecodeDelta error %v, want %v", c.name, err, c.want)
		}
	}
}

// Keys are uniform hashes, so sorting them and coding the gaps as varints
// does not pay: this pins the measurement behind the raw 8 B/key encoding.
func TestDeltaKeysDoNotCompress(t *testing.T) {
	for _, n := range []int{20, 150, 2000} {
		keys := randomKeys(uint64(n), n)
		sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
		var buf []byte
		prev := uint64(0)
		for _, k := range keys {
			buf = binary.AppendUvarint(buf, k-prev)
			prev = k
		}
		perKey := float64(len(buf)) / float64(n)
		t.Logf("%d keys: sorted varint gaps %.2f B/key vs 8 raw", n, perKey)
		if perKey < 7.2 {
			t.Fatalf("varint gaps %.2f B/key: compression would pay after all", perKey)
		}
	}
}

// addSnapshotSeeds seeds a snapshot decoder's fuzzing: a snapshot holding
// key 42, and a truncated header.
func addSnapshotSeeds(f *testing.F) {
	g := NewGenerations(GenerationConfig{Capacity: 50}, 3, t0)
	g.Add(42)
	s := g.Snapshot()
	f.Add(s.AppendBinary(nil))
	f.Add([]byte("KB\x01\x01"))
}

func FuzzDecodeSnapshot(f *testing.F) {
	addSnapshotSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := DecodeSnapshot(b)
		if err != nil {
			return
		}
		if _, err := FromWords(s.Words, s.M, s.K); err != nil {
			t.Fatalf("decoded snapshot has invalid geometry: %v", err)
		}
		var m Mirror
		if err := m.ApplySnapshot(s); err != nil {
			t.Fatalf("mirror refused a decoded snapshot: %v", err)
		}
		m.Filter().Test(42)
		if again := s.AppendBinary(nil); !slices.Equal(again, b) {
			t.Fatal("re-encoding differs from the input")
		}
	})
}

// addDeltaSeeds seeds a delta decoder's fuzzing: a delta of two keys, and
// a truncated header.
func addDeltaSeeds(f *testing.F) {
	d := Delta{Epoch: 1, Generation: 2, Seq: 3, Keys: []uint64{4, 5}}
	f.Add(d.AppendBinary(nil))
	f.Add([]byte("KB\x01\x02"))
}

func FuzzDecodeDelta(f *testing.F) {
	addDeltaSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := DecodeDelta(b)
		if err != nil {
			return
		}
		if again := d.AppendBinary(nil); !slices.Equal(again, b) {
			t.Fatal("re-encoding differs from the input")
		}
	})
}

func TestMaxCapacityIsTheLargestThatFits(t *testing.T) {
	for _, tc := range []struct {
		fpr   float64
		bytes int
	}{{0.01, 20 << 20}, {0.001, 1 << 20}, {0.01, 4096}} {
		c := MaxCapacity(tc.fpr, tc.bytes)
		size := func(c int) int { return SnapshotSize(NewFilter(uint(c), tc.fpr).M()) }
		if size(c) > tc.bytes || size(c+1) <= tc.bytes {
			t.Fatalf("MaxCapacity(%v, %d) = %d: its snapshot takes %d, one more key's %d", tc.fpr, tc.bytes, c, size(c), size(c+1))
		}
		t.Logf("fpr %v, %d bytes: %d keys", tc.fpr, tc.bytes, c)
	}
	if MaxCapacity(0.01, 10) != 0 {
		t.Fatal("a limit below one block fits keys")
	}
}
