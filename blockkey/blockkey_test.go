package blockkey

import "testing"

func TestAppendChainsFullBlocksOnly(t *testing.T) {
	tokens := make([]uint32, 40)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys := Append(nil, Seed("", ""), tokens, 16)
	if len(keys) != 2 {
		t.Fatalf("40 tokens in blocks of 16: got %d keys, want 2", len(keys))
	}
	if want := Next(Seed("", ""), tokens[:16]); keys[0] != want {
		t.Fatalf("key 0 = %x, want %x", keys[0], want)
	}
	if want := Next(keys[0], tokens[16:32]); keys[1] != want {
		t.Fatalf("key 1 = %x, want %x (chained on key 0)", keys[1], want)
	}
}

func TestSameBlockDifferentPrefixDiffers(t *testing.T) {
	a := []uint32{1, 2, 3, 4, 9, 9, 9, 9}
	b := []uint32{5, 6, 7, 8, 9, 9, 9, 9}
	ka := Append(nil, Seed("", ""), a, 4)
	kb := Append(nil, Seed("", ""), b, 4)
	if ka[1] == kb[1] {
		t.Fatal("identical second blocks after different first blocks share a key")
	}
}

func TestSeedsSeparateAdaptersAndSalts(t *testing.T) {
	seeds := map[uint64]string{}
	for _, c := range [][2]string{{"", ""}, {"lora-a", ""}, {"lora-b", ""}, {"", "salt"}, {"lora-a", "salt"}, {"lora-", "asalt"}} {
		s := Seed(c[0], c[1])
		if prev, dup := seeds[s]; dup {
			t.Fatalf("seed collision between %q and %v", prev, c)
		}
		seeds[s] = c[0] + "|" + c[1]
	}
}

func TestKeysAreStable(t *testing.T) {
	// Sidecars and routers of different builds must agree on keys; changing
	// this value is a protocol change and must bump SchemeVersion.
	got := Append(nil, Seed("", ""), []uint32{1, 2, 3, 4}, 4)
	if got[0] != 0x7132c13eb4fd2630 {
		t.Fatalf("key of [1 2 3 4] = %#x; the key scheme changed without bumping SchemeVersion", got[0])
	}
}

func BenchmarkAppend256Blocks(b *testing.B) {
	tokens := make([]uint32, 256*16)
	for i := range tokens {
		tokens[i] = uint32(i * 7919)
	}
	dst := make([]uint64, 0, 256)
	b.SetBytes(int64(len(tokens) * 4))
	b.ReportAllocs()
	for b.Loop() {
		dst = Append(dst[:0], Seed("", ""), tokens, 16)
	}
}
