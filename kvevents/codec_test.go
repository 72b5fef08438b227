package kvevents

import (
	"bytes"
	"encoding/hex"
	"errors"
	"math"
	"math/rand/v2"
	"os/exec"
	"strings"
	"testing"
)

// hx is hand-written msgpack in hex (spaces ignored); wire concatenates hx
// parts with raw string parts (the bytes of a msgpack str body).
type hx string

func wire(parts ...any) []byte {
	var out []byte
	for _, p := range parts {
		switch v := p.(type) {
		case hx:
			b, err := hex.DecodeString(strings.ReplaceAll(string(v), " ", ""))
			if err != nil {
				panic(err)
			}
			out = append(out, b...)
		case string:
			out = append(out, v...)
		case []byte:
			out = append(out, v...)
		default:
			panic("wire: bad part")
		}
	}
	return out
}

// The §1.7 example: one BlockStored of 16 Qwen token ids, captured from vLLM
// v0.26.0 in map form. Hash 15760518052499183552 = 0xdab89baa7b5857c0, ts
// 1789095808.8378847 = float64 bits 0x41daa8dbe0359fe7.
var (
	exampleTokens = []uint32{151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667}
	exampleTS     = 1789095808.8378847
	exampleHash   = uint64(15760518052499183552)

	// 16 token ids: array16, then the smallest int encoding of each.
	exampleTokenBytes = hx("dc 0010" +
		"ce 0002505c  cd 0368  cc c6  cd 2368  cd 0176  cd 0117  cd 1a42  cd 013b" +
		"cd 15f0  1e  ce 0002505d  cc c6  ce 0002505c  ce 00012d23  cc c6  ce 00025073")

	exampleMapWire = wire(
		hx("93"),                  // batch [ts, events, dp_rank]
		hx("cb 41daa8dbe0359fe7"), // ts float64
		hx("91"),                  // one event
		hx("8b"),                  // map of 11 keys (kv_cache_spec_sliding_window omitted: None)
		hx("a4"), "type", hx("ab"), "BlockStored",
		hx("ac"), "block_hashes", hx("91 cf dab89baa7b5857c0"),
		hx("b1"), "parent_block_hash", hx("c0"),
		hx("a9"), "token_ids", exampleTokenBytes,
		hx("aa"), "block_size", hx("10"),
		hx("a7"), "lora_id", hx("c0"),
		hx("a6"), "medium", hx("a3"), "GPU",
		hx("a9"), "lora_name", hx("c0"),
		hx("aa"), "extra_keys", hx("91 c0"),
		hx("a9"), "group_idx", hx("00"),
		hx("b2"), "kv_cache_spec_kind", hx("ae"), "full_attention",
		hx("00"), // data_parallel_rank 0
	)

	// (b): the same event array-like, as vLLM emitted it before #42892.
	exampleArrayWire = wire(
		hx("93 cb 41daa8dbe0359fe7 91"),
		hx("9b"), // 11 elements: tag .. kv_cache_spec_kind (trailing None dropped)
		hx("ab"), "BlockStored",
		hx("91 cf dab89baa7b5857c0"), // block_hashes
		hx("c0"),                     // parent_block_hash
		exampleTokenBytes,
		hx("10"),        // block_size
		hx("c0"),        // lora_id
		hx("a3"), "GPU", // medium
		hx("c0"),    // lora_name
		hx("91 c0"), // extra_keys [None]
		hx("00"),    // group_idx
		hx("ae"), "full_attention",
		hx("00"),
	)
)

func exampleEvent() Event {
	return Event{
		Kind:        KindBlockStored,
		BlockHashes: []uint64{exampleHash},
		TokenIDs:    exampleTokens,
		BlockSize:   16,
		Medium:      "GPU",
		ExtraKeys:   []byte{0x91, 0xc0},
		HasGroupIdx: true,
		SpecKind:    "full_attention",
	}
}

func TestExampleMapFormGoldenBytes(t *testing.T) {
	var b Batch
	if err := DecodeBatch(exampleMapWire, &b); err != nil {
		t.Fatal(err)
	}
	want := Batch{TS: exampleTS, DPRank: 0, Events: []Event{exampleEvent()}}
	assertBatch(t, &b, &want)
	if got := AppendBatch(nil, &want, FormatVLLMMap); !bytes.Equal(got, exampleMapWire) {
		t.Fatalf("map encoding differs:\n got %x\nwant %x", got, exampleMapWire)
	}
}

func TestExampleArrayFormGoldenBytes(t *testing.T) {
	var b Batch
	if err := DecodeBatch(exampleArrayWire, &b); err != nil {
		t.Fatal(err)
	}
	want := Batch{TS: exampleTS, DPRank: 0, Events: []Event{exampleEvent()}}
	assertBatch(t, &b, &want)
	if got := AppendBatch(nil, &want, FormatVLLMArray); !bytes.Equal(got, exampleArrayWire) {
		t.Fatalf("array encoding differs:\n got %x\nwant %x", got, exampleArrayWire)
	}
}

// (c): the late-2025 8-element layout (lora_name present, nothing after),
// with fixture hashes 17705339885301241772 and 13360521540053240825.
func TestLate2025ArrayLayout(t *testing.T) {
	payload := wire(
		hx("93 cb 41daa8dbe0359fe7 91"),
		hx("98"), hx("ab"), "BlockStored",
		hx("92 cf f5b600d19aef97ac cf b96a1b8db8d40bf9"),
		hx("c0"),
		hx("9f 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e"), // 15 ids (partial block ok)
		hx("10 c0"), hx("a3"), "GPU", hx("c0"),
		hx("00"),
	)
	var b Batch
	if err := DecodeBatch(payload, &b); err != nil {
		t.Fatal(err)
	}
	want := Batch{TS: exampleTS, Events: []Event{{
		Kind:        KindBlockStored,
		BlockHashes: []uint64{17705339885301241772, 13360521540053240825},
		TokenIDs:    []uint32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14},
		BlockSize:   16, Medium: "GPU",
	}}}
	assertBatch(t, &b, &want)
	if got := AppendBatch(nil, &want, FormatVLLMArray); !bytes.Equal(got, payload) {
		t.Fatalf("got %x\nwant %x", got, payload)
	}
}

func TestSGLangLayouts(t *testing.T) {
	// -2 as int64 is 0xfffffffffffffffe; SGLang hashes are signed.
	payload := wire(
		hx("93 cb 3ff0000000000000 94"),
		// Dec-2025: 6 elements, no medium.
		hx("96"), hx("ab"), "BlockStored", hx("91 fe"), hx("c0"), hx("92 01 02"), hx("02 c0"),
		// mid-2026: 7 elements with a medium, parent int64, metadata map.
		hx("98"), hx("ab"), "BlockStored", hx("91 d3 8000000000000000"), hx("fe"), hx("92 03 04"), hx("02 c0"),
		hx("a3"), "GPU", hx("81 aa"), "cache_salt", hx("a4"), "salt",
		// BlockRemoved with only hashes.
		hx("92"), hx("ac"), "BlockRemoved", hx("91 fe"),
		hx("91"), hx("b0"), "AllBlocksCleared",
		hx("01"), // attn_dp_rank
	)
	var b Batch
	if err := DecodeBatch(payload, &b); err != nil {
		t.Fatal(err)
	}
	minus2 := uint64(math.MaxUint64 - 1)
	want := Batch{TS: 1, DPRank: 1, Events: []Event{
		{Kind: KindBlockStored, BlockHashes: []uint64{minus2}, TokenIDs: []uint32{1, 2}, BlockSize: 2},
		{Kind: KindBlockStored, BlockHashes: []uint64{1 << 63}, HasParent: true, ParentHash: minus2,
			TokenIDs: []uint32{3, 4}, BlockSize: 2, Medium: "GPU", CacheSalt: "salt"},
		{Kind: KindBlockRemoved, BlockHashes: []uint64{minus2}},
		{Kind: KindAllBlocksCleared},
	}}
	assertBatch(t, &b, &want)

	// The SGLang encoder writes the 7-element layout (6-element events gain
	// a nil medium) and signed hashes.
	wantWire := wire(
		hx("93 cb 3ff0000000000000 94"),
		hx("97"), hx("ab"), "BlockStored", hx("91 fe"), hx("c0"), hx("92 01 02"), hx("02 c0 c0"),
		hx("98"), hx("ab"), "BlockStored", hx("91 d3 8000000000000000"), hx("fe"), hx("92 03 04"), hx("02 c0"),
		hx("a3"), "GPU", hx("81 aa"), "cache_salt", hx("a4"), "salt",
		hx("92"), hx("ac"), "BlockRemoved", hx("91 fe"),
		hx("91"), hx("b0"), "AllBlocksCleared",
		hx("01"),
	)
	if got := AppendBatch(nil, &want, FormatSGLang); !bytes.Equal(got, wantWire) {
		t.Fatalf("got %x\nwant %x", got, wantWire)
	}
}

func TestSGLangMapEventsWithCacheSalt(t *testing.T) {
	payload := wire(
		hx("93 cb 3ff0000000000000 91"),
		hx("87"), hx("a4"), "type", hx("ab"), "BlockStored",
		hx("ac"), "block_hashes", hx("91 d3 8000000000000001"),
		hx("b1"), "parent_block_hash", hx("c0"),
		hx("a9"), "token_ids", hx("91 05"),
		hx("aa"), "block_size", hx("01"),
		hx("aa"), "cache_salt", hx("a1"), "s",
		hx("aa"), "session_id", hx("a3"), "abc", // unknown key: skipped
		hx("00"),
	)
	var b Batch
	if err := DecodeBatch(payload, &b); err != nil {
		t.Fatal(err)
	}
	want := Batch{TS: 1, DPRank: 0, Events: []Event{{Kind: KindBlockStored,
		BlockHashes: []uint64{1<<63 | 1}, TokenIDs: []uint32{5}, BlockSize: 1, CacheSalt: "s"}}}
	assertBatch(t, &b, &want)
}

func TestBatchShapes(t *testing.T) {
	cleared := wire(hx("91"), hx("b0"), "AllBlocksCleared")
	tests := []struct {
		name    string
		payload []byte
		ts      float64
		rank    int
		events  int
	}{
		{"array of 2 (pre-v0.9.1)", wire(hx("92 cb 4000000000000000 91"), cleared), 2, -1, 1},
		{"array of 3", wire(hx("93 cb 4000000000000000 91"), cleared, hx("05")), 2, 5, 1},
		{"array of 3, nil rank", wire(hx("93 cb 4000000000000000 91"), cleared, hx("c0")), 2, -1, 1},
		{"array with extra trailing", wire(hx("94 cb 4000000000000000 90 07 a1"), "x"), 2, 7, 0},
		{"float32 ts", wire(hx("92 ca 40400000 90")), 3, -1, 0},
		{"int ts", wire(hx("92 07 90")), 7, -1, 0},
		{"nil events", wire(hx("92 07 c0")), 7, -1, 0},
		{"map batch", wire(hx("83 a2"), "ts", hx("cb 4000000000000000"), hx("a6"), "events", hx("91"), cleared,
			hx("b2"), "data_parallel_rank", hx("03")), 2, 3, 1},
		{"map batch, attn_dp_rank and unknown key", wire(hx("83 ac"), "attn_dp_rank", hx("02"), hx("a1"), "z",
			hx("92 c3 c2"), hx("a6"), "events", hx("90")), 0, 2, 0},
		{"map batch, empty", wire(hx("80")), 0, -1, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := Batch{TS: 99, DPRank: 99, Events: make([]Event, 3)}
			if err := DecodeBatch(tc.payload, &b); err != nil {
				t.Fatal(err)
			}
			if b.TS != tc.ts || b.DPRank != tc.rank || len(b.Events) != tc.events {
				t.Fatalf("got ts=%v rank=%d events=%d, want %v %d %d", b.TS, b.DPRank, len(b.Events), tc.ts, tc.rank, tc.events)
			}
		})
	}
}

func TestEventTolerances(t *testing.T) {
	batch := func(events ...[]byte) []byte { // [0, events] with fewer than 16 events
		out := []byte{0x92, 0x00, 0x90 | byte(len(events))}
		for _, e := range events {
			out = append(out, e...)
		}
		return out
	}
	tests := []struct {
		name string
		wire []byte
		want []Event
	}{
		{"stored with only hashes", batch(wire(hx("92 ab"), "BlockStored", hx("91 01"))),
			[]Event{{Kind: KindBlockStored, BlockHashes: []uint64{1}}}},
		{"stored with 13 elements", batch(wire(hx("9d ab"), "BlockStored", hx("91 01 c0 90 10 c0 c0 c0 c0 c0 c0 c0"), hx("a5"), "LOCAL")),
			[]Event{{Kind: KindBlockStored, BlockHashes: []uint64{1}, BlockSize: 16}}},
		{"removed with group and extra", batch(wire(hx("95 ac"), "BlockRemoved", hx("91 02"), hx("a3"), "CPU", hx("03 a1"), "x")),
			[]Event{{Kind: KindBlockRemoved, BlockHashes: []uint64{2}, Medium: "CPU", GroupIdx: 3, HasGroupIdx: true}}},
		{"unknown array tag", batch(wire(hx("93 a9"), "BlockMove", hx("91 01 c0"))),
			[]Event{{Kind: KindUnknown}}},
		{"unknown map tag", batch(wire(hx("82 a4"), "type", hx("a9"), "BlockMove", hx("ac"), "block_hashes", hx("91 01"))),
			[]Event{{Kind: KindUnknown}}},
		{"map without type", batch(wire(hx("81 ac"), "block_hashes", hx("91 01"))),
			[]Event{{Kind: KindUnknown}}},
		{"map with type last and foreign keys", batch(wire(hx("83 ac"), "block_hashes", hx("91 01"), hx("a9"), "token_ids", hx("91 05"),
			hx("a4"), "type", hx("ac"), "BlockRemoved")),
			[]Event{{Kind: KindBlockRemoved, BlockHashes: []uint64{1}}}},
		{"cleared with extras", batch(wire(hx("92 b0"), "AllBlocksCleared", hx("c3"))),
			[]Event{{Kind: KindAllBlocksCleared}}},
		{"nil everything", batch(wire(hx("9c ab"), "BlockStored", hx("c0 c0 c0 c0 c0 c0 c0 c0 c0 c0 c0"))),
			[]Event{{Kind: KindBlockStored}}},
		{"metadata nil", batch(wire(hx("98 ab"), "BlockStored", hx("90 c0 90 01 c0 c0 c0"))),
			[]Event{{Kind: KindBlockStored, BlockSize: 1}}},
		{"parent zero is still a parent", batch(wire(hx("93 ab"), "BlockStored", hx("90 00"))),
			[]Event{{Kind: KindBlockStored, HasParent: true}}},
		{"lora", batch(wire(hx("98 ab"), "BlockStored", hx("90 c0 90 10 d2 80000000"), hx("a3"), "GPU", hx("a5"), "Alice")),
			[]Event{{Kind: KindBlockStored, BlockSize: 16, LoRAID: math.MinInt32, Medium: "GPU", LoRAName: "Alice"}}},
		{"sliding window", batch(wire(hx("9c ab"), "BlockStored", hx("90 c0 90 10 c0 c0 c0 c0 01"), hx("ae"), "sliding_window", hx("cd 1000"))),
			[]Event{{Kind: KindBlockStored, BlockSize: 16, GroupIdx: 1, HasGroupIdx: true, SpecKind: "sliding_window", SlidingWindow: 4096}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var b Batch
			if err := DecodeBatch(tc.wire, &b); err != nil {
				t.Fatal(err)
			}
			assertBatch(t, &b, &Batch{DPRank: -1, Events: tc.want})
		})
	}
}

func TestHashEncodings(t *testing.T) {
	digest := make([]byte, 32)
	for i := range digest {
		digest[i] = byte(i)
	}
	tests := []struct {
		name string
		enc  []byte
		want uint64
	}{
		{"positive fixint", wire(hx("7f")), 127},
		{"uint8", wire(hx("cc ff")), 255},
		{"uint16", wire(hx("cd ffff")), 65535},
		{"uint32", wire(hx("ce ffffffff")), math.MaxUint32},
		{"uint64 >= 2^63", wire(hx("cf dab89baa7b5857c0")), exampleHash},
		{"negative fixint", wire(hx("ff")), math.MaxUint64},
		{"int8", wire(hx("d0 80")), uint64(1<<64 - 128)},
		{"int16", wire(hx("d1 8000")), uint64(1<<64 - 32768)},
		{"int32", wire(hx("d2 80000000")), uint64(1<<64 - 1<<31)},
		{"int64", wire(hx("d3 8000000000000000")), 1 << 63},
		{"int64 positive", wire(hx("d3 0000000000000005")), 5},
		{"uint64 small in wide encoding", wire(hx("cf 0000000000000001")), 1},
		{"bin 32 (sha256 digest): last 8 bytes", append(wire(hx("c4 20")), digest...), 0x18191a1b1c1d1e1f},
		{"bin 16 (xxhash128)", append(wire(hx("c4 10")), digest[:16]...), 0x08090a0b0c0d0e0f},
		{"bin16 header", append(wire(hx("c5 0020")), digest...), 0x18191a1b1c1d1e1f},
		{"bin 3: left-padded", wire(hx("c4 03 010203")), 0x010203},
		{"bin empty", wire(hx("c4 00")), 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// As a block hash and as the parent.
			payload := wire(hx("92 00 91 94 ab"), "BlockStored", hx("91"), string(tc.enc), string(tc.enc), hx("90"))
			var b Batch
			if err := DecodeBatch(payload, &b); err != nil {
				t.Fatal(err)
			}
			ev := b.Events[0]
			if ev.BlockHashes[0] != tc.want || !ev.HasParent || ev.ParentHash != tc.want {
				t.Fatalf("hash %#x parent %#x (has %v), want %#x", ev.BlockHashes[0], ev.ParentHash, ev.HasParent, tc.want)
			}
		})
	}
}

func TestMalformedInputIsATypedError(t *testing.T) {
	stored := func(rest ...any) []byte {
		return wire(append([]any{hx("92 00 91 9c ab"), "BlockStored"}, rest...)...)
	}
	tests := []struct {
		name    string
		payload []byte
		reason  string
	}{
		{"empty", nil, "truncated"},
		{"not a container", wire(hx("05")), "want array or map"},
		{"batch of one", wire(hx("91 00")), "at least 2"},
		{"ts is a string", wire(hx("92 a1"), "x", hx("90")), "want integer"},
		{"events is a map", wire(hx("92 00 80")), "want array, got map"},
		{"absurd array length", wire(hx("92 00 dd ffffffff")), "exceeds"},
		{"absurd map length", wire(hx("df ffffffff")), "exceeds"},
		{"absurd str length", wire(hx("92 00 91 91 db ffffffff")), "truncated"},
		{"trailing bytes", wire(hx("92 00 90 00")), "trailing"},
		{"truncated float", wire(hx("92 cb 0000")), "truncated"},
		{"empty event", wire(hx("92 00 91 90")), "no tag"},
		{"tag not a string", wire(hx("92 00 91 91 01")), "want string"},
		{"hash is a string", stored(hx("91 a1"), "x"), "want integer"},
		{"hash is nil", stored(hx("91 c0")), "want integer"},
		{"hashes is an int", stored(hx("01")), "want array or map"},
		{"token negative", stored(hx("90 c0 91 ff")), "out of uint32"},
		{"token too big", stored(hx("90 c0 91 cf 0000000100000000")), "out of uint32"},
		{"block size uint64 overflow", stored(hx("90 c0 90 cf ffffffffffffffff")), "overflows int64"},
		{"medium is an int", stored(hx("90 c0 90 10 c0 01")), "want string"},
		{"metadata is an array", wire(hx("92 00 91 98 ab"), "BlockStored", hx("90 c0 90 10 c0 c0 91 00")), "want string"},
		{"invalid code", wire(hx("92 00 91 92 a1"), "x", hx("c1")), "invalid msgpack code"},
		{"too deep", wire(hx("92 00 91 92 a1"), "x", strings.Repeat("\x91", 100), hx("00")), "nesting"},
		{"truncated ext", wire(hx("92 00 91 92 a1"), "x", hx("c7 ff 01")), "truncated"},
		{"truncated hash", stored(hx("91 cf 0102")), "truncated"},
		{"truncated inline token", stored(hx("90 c0 91 ce 0102")), "truncated"},
		{"map key not a string", wire(hx("92 00 91 81 01 01")), "want string"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var b Batch
			err := DecodeBatch(tc.payload, &b)
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("err = %v (%T), want *DecodeError", err, err)
			}
			if !strings.Contains(de.Reason, tc.reason) {
				t.Fatalf("reason %q does not mention %q", de.Reason, tc.reason)
			}
			if de.Offset < 0 || de.Offset > len(tc.payload) {
				t.Fatalf("offset %d outside payload of %d bytes", de.Offset, len(tc.payload))
			}
		})
	}
}

func TestDecodeErrorSaysWhere(t *testing.T) {
	payload := wire(hx("92 00 92 91 b0"), "AllBlocksCleared", hx("92 ab"), "BlockStored", hx("91 a1"), "x")
	err := DecodeBatch(payload, &Batch{})
	var de *DecodeError
	if !errors.As(err, &de) || de.Event != 1 || de.Field != "block_hashes" || de.Offset != len(payload)-2 {
		t.Fatalf("got %#v", err)
	}
	if !strings.Contains(err.Error(), "event 1 field block_hashes at byte") {
		t.Fatalf("message %q", err)
	}
}

// randomBatch builds a batch with every field exercised; seed fixes it.
func randomBatch(rng *rand.Rand) Batch {
	b := Batch{TS: rng.Float64() * 2e9, DPRank: rng.IntN(4) - 1}
	n := rng.IntN(6)
	for range n {
		var ev Event
		switch rng.IntN(4) {
		case 0, 1:
			ev.Kind = KindBlockStored
			nb := 1 + rng.IntN(4)
			bs := []int{1, 16, 64}[rng.IntN(3)]
			for range nb {
				ev.BlockHashes = append(ev.BlockHashes, rng.Uint64()>>(rng.IntN(64)))
			}
			for range nb * bs {
				ev.TokenIDs = append(ev.TokenIDs, rng.Uint32()>>(rng.IntN(32)))
			}
			ev.BlockSize = bs
			if rng.IntN(5) == 0 { // SGLang EAGLE: ids as bigram pairs
				ev.Bigram, ev.BigramLast = true, rng.Uint32()
			}
			if rng.IntN(2) == 0 {
				ev.HasParent, ev.ParentHash = true, rng.Uint64()
			}
			if rng.IntN(3) == 0 {
				ev.LoRAID, ev.LoRAName = int64(1+rng.IntN(1000)), "adapter-"+strings.Repeat("x", rng.IntN(40))
			}
			ev.Medium = []string{"", "GPU", "CPU"}[rng.IntN(3)]
			if rng.IntN(2) == 0 {
				ev.ExtraKeys = []byte{0x91, 0xc0}
			}
			if rng.IntN(2) == 0 {
				ev.HasGroupIdx, ev.GroupIdx = true, rng.IntN(3)
			}
			if rng.IntN(3) == 0 {
				ev.SpecKind = "full_attention"
			}
			if rng.IntN(4) == 0 {
				ev.SpecKind, ev.SlidingWindow = "sliding_window", 1+rng.IntN(8192)
			}
			if rng.IntN(3) == 0 {
				ev.CacheSalt = "salt"
			}
		case 2:
			ev.Kind = KindBlockRemoved
			for range 1 + rng.IntN(3) {
				ev.BlockHashes = append(ev.BlockHashes, rng.Uint64())
			}
			ev.Medium = []string{"", "GPU", "cpu"}[rng.IntN(3)]
			if rng.IntN(2) == 0 {
				ev.HasGroupIdx, ev.GroupIdx = true, rng.IntN(3)
			}
		default:
			ev.Kind = KindAllBlocksCleared
		}
		b.Events = append(b.Events, ev)
	}
	return b
}

// projected returns what survives encoding b in format f.
func projected(b *Batch, f Format) Batch {
	out := Batch{TS: b.TS, DPRank: b.DPRank}
	for _, ev := range b.Events {
		if ev.Kind == KindUnknown {
			continue
		}
		switch f {
		case FormatVLLMArray:
			ev.CacheSalt = ""
		case FormatSGLang:
			salt, medium := ev.CacheSalt, ev.Medium
			ev = Event{Kind: ev.Kind, BlockHashes: ev.BlockHashes, TokenIDs: ev.TokenIDs, BlockSize: ev.BlockSize,
				ParentHash: ev.ParentHash, HasParent: ev.HasParent, LoRAID: ev.LoRAID, Bigram: ev.Bigram, BigramLast: ev.BigramLast}
			if ev.Kind == KindBlockStored {
				ev.CacheSalt, ev.Medium = salt, medium
			}
		}
		out.Events = append(out.Events, ev)
	}
	return out
}

func TestRoundTripEveryFormat(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var got Batch // reused across iterations on purpose
	for i := 0; i < 500; i++ {
		b := randomBatch(rng)
		for _, f := range []Format{FormatVLLMMap, FormatVLLMArray, FormatSGLang} {
			payload := AppendBatch(nil, &b, f)
			if err := DecodeBatch(payload, &got); err != nil {
				t.Fatalf("batch %d format %v: %v\n%x", i, f, err, payload)
			}
			want := projected(&b, f)
			if !batchEqual(&got, &want) {
				t.Fatalf("batch %d format %v:\n got %+v\nwant %+v", i, f, got, want)
			}
		}
	}
}

func TestFormatNames(t *testing.T) {
	for _, f := range []Format{FormatVLLMMap, FormatVLLMArray, FormatSGLang} {
		g, err := ParseFormat(f.String())
		if err != nil || g != f {
			t.Fatalf("%v: %v %v", f, g, err)
		}
	}
	if _, err := ParseFormat("json"); err == nil {
		t.Fatal("ParseFormat accepted json")
	}
}

func TestLongStringsAndArrays(t *testing.T) {
	ev := Event{Kind: KindBlockStored, BlockSize: 16, LoRAName: strings.Repeat("n", 300), Medium: strings.Repeat("m", 40)}
	for range 70000 {
		ev.TokenIDs = append(ev.TokenIDs, 70000)
	}
	for range 20 {
		ev.BlockHashes = append(ev.BlockHashes, 1)
	}
	b := Batch{TS: 1, DPRank: -1, Events: []Event{ev}}
	for _, f := range []Format{FormatVLLMMap, FormatVLLMArray} {
		payload := AppendBatch(nil, &b, f)
		var got Batch
		if err := DecodeBatch(payload, &got); err != nil {
			t.Fatal(err)
		}
		if !batchEqual(&got, &b) {
			t.Fatalf("%v: long values did not round-trip", f)
		}
	}
	// str8/str16, array16/array32 headers in msgspec's choice.
	if got := appendStr(nil, strings.Repeat("a", 32))[:2]; !bytes.Equal(got, []byte{0xd9, 32}) {
		t.Fatalf("str8 header %x", got)
	}
	if got := appendStr(nil, strings.Repeat("a", 256))[:3]; !bytes.Equal(got, []byte{0xda, 1, 0}) {
		t.Fatalf("str16 header %x", got)
	}
	if got := appendArrayHeader(nil, 70000); !bytes.Equal(got, []byte{0xdd, 0, 1, 0x11, 0x70}) {
		t.Fatalf("array32 header %x", got)
	}
	if got := appendMapHeader(nil, 16); !bytes.Equal(got, []byte{0xde, 0, 16}) {
		t.Fatalf("map16 header %x", got)
	}
	if got := appendInt(nil, -33); !bytes.Equal(got, []byte{0xd0, 0xdf}) {
		t.Fatalf("int8 %x", got)
	}
	if got := appendInt(nil, -32769); !bytes.Equal(got, []byte{0xd2, 0xff, 0xff, 0x7f, 0xff}) {
		t.Fatalf("int32 %x", got)
	}
}

func TestDecodeReusesSlicesWithoutAllocating(t *testing.T) {
	b := Batch{TS: 1, DPRank: 0}
	for i := range 64 {
		ev := Event{Kind: KindBlockStored, BlockHashes: []uint64{uint64(i) << 50}, TokenIDs: exampleTokens,
			BlockSize: 16, Medium: "GPU", HasParent: i > 0, ParentHash: uint64(i), LoRAName: "custom-adapter"}
		b.Events = append(b.Events, ev, Event{Kind: KindBlockRemoved, BlockHashes: []uint64{7}, Medium: "GPU"})
	}
	for _, f := range []Format{FormatVLLMMap, FormatVLLMArray} {
		payload := AppendBatch(nil, &b, f)
		var got Batch
		if err := DecodeBatch(payload, &got); err != nil { // warm up
			t.Fatal(err)
		}
		allocs := testing.AllocsPerRun(100, func() {
			if err := DecodeBatch(payload, &got); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Fatalf("%v: %.1f allocations per warm decode, want 0", f, allocs)
		}
	}
}

func batchEqual(a, b *Batch) bool {
	if math.Float64bits(a.TS) != math.Float64bits(b.TS) && !(a.TS != a.TS && b.TS != b.TS) || a.DPRank != b.DPRank || len(a.Events) != len(b.Events) {
		return false
	}
	for i := range a.Events {
		if !eventEqual(&a.Events[i], &b.Events[i]) {
			return false
		}
	}
	return true
}

// eventEqual compares events treating nil and empty slices alike.
func eventEqual(a, b *Event) bool {
	if len(a.BlockHashes) != len(b.BlockHashes) || len(a.TokenIDs) != len(b.TokenIDs) {
		return false
	}
	for i := range a.BlockHashes {
		if a.BlockHashes[i] != b.BlockHashes[i] {
			return false
		}
	}
	for i := range a.TokenIDs {
		if a.TokenIDs[i] != b.TokenIDs[i] {
			return false
		}
	}
	return a.Kind == b.Kind && a.ParentHash == b.ParentHash && a.HasParent == b.HasParent &&
		a.BlockSize == b.BlockSize && a.LoRAID == b.LoRAID && a.LoRAName == b.LoRAName &&
		a.Medium == b.Medium && a.GroupIdx == b.GroupIdx && a.HasGroupIdx == b.HasGroupIdx &&
		a.CacheSalt == b.CacheSalt && a.SpecKind == b.SpecKind && a.SlidingWindow == b.SlidingWindow &&
		a.Bigram == b.Bigram && a.BigramLast == b.BigramLast &&
		bytes.Equal(a.ExtraKeys, b.ExtraKeys)
}

func assertBatch(t *testing.T, got, want *Batch) {
	t.Helper()
	if !batchEqual(got, want) {
		t.Fatalf("decoded batch differs:\n got %+v\nwant %+v", *got, *want)
	}
}

// msgspec, like Python's msgpack packer, writes every value in its smallest
// encoding, so packb(unpackb(x)) == x holds exactly for bytes such a
// producer emits. Checked here on AppendBatch's output for random batches in
// every format, with the msgpack package Debian ships (skipped without it).
func TestEncodingIsCanonicalPerPythonMsgpack(t *testing.T) {
	py := pythonWithZMQ()
	if py == "" {
		t.Skip("no python3 with msgpack (apt-get install python3-msgpack python3-zmq)")
	}
	var in strings.Builder
	rng := rand.New(rand.NewPCG(5, 6))
	n := 0
	for range 100 {
		b := randomBatch(rng)
		for _, f := range []Format{FormatVLLMMap, FormatVLLMArray, FormatSGLang} {
			in.WriteString(hex.EncodeToString(AppendBatch(nil, &b, f)) + "\n")
			n++
		}
	}
	in.WriteString(hex.EncodeToString(exampleMapWire) + "\n")
	const script = `
import sys, msgpack
bad = 0
for line in sys.stdin:
    x = bytes.fromhex(line.strip())
    if msgpack.packb(msgpack.unpackb(x, strict_map_key=False)) != x:
        bad += 1
        print("not canonical:", x.hex())
print("checked", bad)
`
	cmd := exec.Command(py, "-c", script)
	cmd.Stdin = strings.NewReader(in.String())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if !strings.HasSuffix(strings.TrimSpace(string(out)), "checked 0") {
		t.Fatalf("python msgpack disagrees on %d payloads:\n%s", n, out)
	}
}

// TestBigramTokenIDs: SGLang with EAGLE sends token_ids as (t[i], t[i+1])
// pairs; the blocks' tokens are the first ids, and the event re-encodes to
// the same bytes.
func TestBigramTokenIDs(t *testing.T) {
	// [1.0, [["BlockStored", [7], nil, [[10,11],[11,12],[12,13]], 3, nil, "GPU"]]]
	payload := wire(hx("92 cb 3ff0000000000000 91 97 ab"), "BlockStored",
		hx("91 07 c0 93 92 0a 0b 92 0b 0c 92 0c 0d 03 c0 a3"), "GPU")
	var b Batch
	if err := DecodeBatch(payload, &b); err != nil {
		t.Fatal(err)
	}
	ev := b.Events[0]
	if !ev.Bigram || ev.BigramLast != 13 || len(ev.TokenIDs) != 3 || ev.TokenIDs[0] != 10 || ev.TokenIDs[2] != 12 {
		t.Fatalf("bigram event decoded as %+v", ev)
	}
	if again := AppendBatch(nil, &b, FormatSGLang); !bytes.Equal(again, payload) {
		t.Fatalf("re-encoded\n%x\nwant\n%x", again, payload)
	}
	bad := bytes.Replace(payload, wire(hx("92 0a 0b")), wire(hx("93 0a 0b 0c")), 1)
	if err := DecodeBatch(bad, &b); err == nil {
		t.Fatal("a bigram of three ids was accepted")
	}
}
