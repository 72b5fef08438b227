package filterstream

import (
	"encoding/hex"
	"reflect"
	"strings"
	"testing"
)

func sampleMessages() []Message {
	return []Message{
		{Kind: KindLoad, From: "sidecar/a", Epoch: 7, Seq: 3, Load: Load{Healthy: true, Waiting: 2, Running: 5, KVUsage: 0.5,
			InflightRequests: 4, InflightPrefillTokens: 900, FilterGen: 2, FilterSeq: 11, FilterKeys: 1234}},
		{Kind: KindLoad, From: "sidecar/a", Epoch: 7, Seq: 4, Load: Load{Leaving: true}},
		{Kind: KindSnapshot, From: "sidecar/a", Epoch: 7, Payload: []byte("KB\x01\x01snap")},
		{Kind: KindDelta, From: "sidecar/a", Epoch: 7, Payload: []byte("KB\x01\x02delta")},
		{Kind: KindResync, From: "router/r1", Epoch: 7},
		{Kind: KindClearRoutes, From: "router/r1", Epoch: 9, Seq: 42, Names: []string{"a", "b"}},
		{Kind: KindClearRoutes, From: "router/r1", Epoch: 9, Seq: 43},
		{Kind: KindInflight, From: "router/r1", Epoch: 9, Seq: 8, Requests: 3, PrefillTokens: 4096},
	}
}

func TestMessageRoundTrip(t *testing.T) {
	for _, m := range sampleMessages() {
		b := m.Append(nil)
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("%s: %v", m.Kind, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("%s: got %+v, want %+v", m.Kind, got, m)
		}
	}
}

func TestLoadRecordGoldenBytes(t *testing.T) {
	m := sampleMessages()[0]
	want := "6b0101" + "09" + hex.EncodeToString([]byte("sidecar/a")) +
		"0700000000000000" + "03" + // epoch, seq
		"01" + "02" + "05" + "0000003f" + "04" + "8407" + "02" + "0b" + "d209"
	if got := hex.EncodeToString(m.Append(nil)); got != want {
		t.Fatalf("load record\n got %s\nwant %s", got, want)
	}
	// A load record fits one datagram with room to spare.
	if n := len(m.Append(nil)); n > 64 {
		t.Fatalf("load record is %d bytes", n)
	}
}

func TestDecodeRejects(t *testing.T) {
	good := sampleMessages()[0].Append(nil)
	cases := map[string][]byte{
		"empty":         nil,
		"magic":         append([]byte{0}, good[1:]...),
		"version":       append([]byte{msgMagic, 9}, good[2:]...),
		"kind":          append([]byte{msgMagic, msgVersion, 99}, good[3:]...),
		"truncated":     good[:len(good)-1],
		"no sender":     (&Message{Kind: KindResync}).Append(nil),
		"nan kv usage":  (&Message{Kind: KindLoad, From: "x", Load: Load{KVUsage: float32NaN()}}).Append(nil),
		"health flag 3": func() []byte { b := append([]byte{}, good...); b[3+1+9+8+1] = 3; return b }(),
	}
	for name, b := range cases {
		if _, err := Decode(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func float32NaN() float32 { var z float32; return z / z }

func TestMetaRoundTripAndLimit(t *testing.T) {
	m := Meta{Role: RoleSidecar, Name: "r1", Models: []string{"llama", "lora-a"}, EngineURL: "http://127.0.0.1:8000",
		Protocol: "vllm", BlockSize: 16, SchemeVersion: 1, Capabilities: CapKVEvents | CapInflight, Epoch: 99}
	b, dropped, err := m.Encode()
	if err != nil || dropped != 0 {
		t.Fatal(err, dropped)
	}
	got, err := DecodeMeta(b)
	if err != nil || !reflect.DeepEqual(got, m) {
		t.Fatalf("got %+v, %v", got, err)
	}
	// Too many adapters for 512 bytes: the tail is left out, never a panic in memberlist.
	for i := range 100 {
		m.Models = append(m.Models, strings.Repeat("x", 20)+string(rune('a'+i%26)))
	}
	b, dropped, err = m.Encode()
	if err != nil || len(b) > MetaMaxSize || dropped == 0 {
		t.Fatalf("len %d dropped %d err %v", len(b), dropped, err)
	}
	got, err = DecodeMeta(b)
	if err != nil || len(got.Models) != len(m.Models)-dropped {
		t.Fatalf("decoded %d models, err %v", len(got.Models), err)
	}
	m.Name = strings.Repeat("n", 600)
	if _, _, err := m.Encode(); err == nil {
		t.Fatal("oversized name accepted")
	}
}

func FuzzDecode(f *testing.F) {
	for _, m := range sampleMessages() {
		f.Add(m.Append(nil))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			return
		}
		// Whatever decodes re-encodes to bytes that decode to the same message.
		again, err := Decode(m.Append(nil))
		if err != nil || !reflect.DeepEqual(again, m) {
			t.Fatalf("re-decode: %+v vs %+v (%v)", again, m, err)
		}
	})
}

func FuzzDecodeMeta(f *testing.F) {
	m := Meta{Role: RoleRouter, Name: "r", Models: []string{"a"}, EngineURL: "u", Protocol: "vllm", BlockSize: 16, SchemeVersion: 1}
	b, _, _ := m.Encode()
	f.Add(b)
	m.Role, m.Capabilities, m.OffloadMedia = RoleSidecar, CapKVEvents|CapTiers, []string{"CPU", "DISK"}
	b, _, _ = m.Encode()
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeMeta(b)
		if err != nil {
			return
		}
		// Two bytes short of the limit: an earlier build's record, without
		// the data-parallel field and the offload media, re-encodes two
		// bytes longer.
		if _, _, err := m.Encode(); err != nil && len(b) < MetaMaxSize-1 {
			t.Fatalf("decoded metadata does not re-encode: %v", err)
		}
	})
}
func BenchmarkLoadRecordCodec(b *testing.B) {
	m := sampleMessages()[0]
	buf := make([]byte, 0, 64)
	b.ReportAllocs()
	for b.Loop() {
		buf = m.Append(buf[:0])
		if _, err := Decode(buf); err != nil {
			b.Fatal(err)
		}
	}
}
