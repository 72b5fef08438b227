package filterstream

import (
	"bytes"
	"encoding/hex"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/bloom"
)

var updateGoldens = flag.Bool("update", false, "rewrite testdata/wire from this build's encoder")

// goldenMessages is every message kind, in each of its shapes, as the
// files in testdata/wire hold them encoded.
func goldenMessages() map[string]Message {
	f := bloom.NewFilter(64, 0.01)
	f.Add(11)
	f.Add(12)
	snap := bloom.Snapshot{Epoch: 7, Generation: 2, Seq: 5, M: f.M(), K: f.K(), Keys: 2, Words: f.AppendWords(nil)}
	delta := bloom.Delta{Epoch: 7, Generation: 2, Seq: 6, Keys: []uint64{13, 1 << 40}}
	return map[string]Message{
		"load": {Kind: KindLoad, From: "sidecar/a", Epoch: 7, Seq: 3, Load: Load{Healthy: true, Waiting: 2, Running: 5,
			KVUsage: 0.5, InflightRequests: 4, InflightPrefillTokens: 900, FilterGen: 2, FilterSeq: 11, FilterKeys: 1234}},
		"load-unhealthy":    {Kind: KindLoad, From: "sidecar/a", Epoch: 7, Seq: 4, Load: Load{Waiting: 1 << 20, KVUsage: 1.5}},
		"load-leaving":      {Kind: KindLoad, From: "sidecar/a", Epoch: 7, Seq: 5, Load: Load{Leaving: true}},
		"snapshot":          {Kind: KindSnapshot, From: "sidecar/a", Epoch: 7, Payload: snap.AppendBinary(nil)},
		"delta":             {Kind: KindDelta, From: "sidecar/a", Epoch: 7, Payload: delta.AppendBinary(nil)},
		"resync-deltas":     {Kind: KindResync, From: "router/r1", Epoch: 7, Seq: 41, Gen: 3},
		"resync-snapshot":   {Kind: KindResync, From: "router/r1"},
		"clear-routes-some": {Kind: KindClearRoutes, From: "router/r1", Epoch: 9, Seq: 1 << 63, Names: []string{"a", "b"}},
		"clear-routes-all":  {Kind: KindClearRoutes, From: "router/r1", Epoch: 9, Seq: 43},
		"inflight":          {Kind: KindInflight, From: "router/r1", Epoch: 9, Seq: 8, Requests: 3, PrefillTokens: 4096},
		"tenant-usage": {Kind: KindTenantUsage, From: "router/r1", Epoch: 9, Usage: []TenantUsage{
			{Tenant: "search", Requests: 120, Tokens: 1 << 33, ReservedRequests: 5, ReservedTokens: 40000},
			{Tenant: "default", Requests: 1},
		}},
	}
}

// goldenMetas is node metadata of both roles as testdata/wire holds it.
func goldenMetas() map[string]Meta {
	return map[string]Meta{
		"meta-sidecar": {Role: RoleSidecar, Name: "a", Models: []string{"llama", "lora-a"}, EngineURL: "http://127.0.0.1:8000",
			Protocol: "vllm", BlockSize: 16, SchemeVersion: 1, Capabilities: CapKVEvents | CapInflight | CapInflightOthers, Epoch: 1<<63 | 7},
		"meta-sidecar-dp": {Role: RoleSidecar, Name: "a-dp3", Models: []string{"llama"}, EngineURL: "http://127.0.0.1:8000",
			Protocol: "vllm", BlockSize: 16, SchemeVersion: 1, Capabilities: CapKVEvents | CapInflight | CapInflightOthers, Epoch: 8,
			DataParallel: true, DataParallelRank: 3},
		"meta-sidecar-tiers": {Role: RoleSidecar, Name: "b", Models: []string{"llama"}, EngineURL: "http://127.0.0.1:8001",
			Protocol: "vllm", BlockSize: 16, SchemeVersion: 1, Capabilities: CapKVEvents | CapInflight | CapInflightOthers | CapTiers, Epoch: 9,
			OffloadMedia: []string{"CPU", "DISK"}},
		"meta-sidecar-prefill": {Role: RoleSidecar, Name: "p", Models: []string{"llama"}, EngineURL: "http://127.0.0.1:8002",
			Protocol: "vllm", BlockSize: 16, SchemeVersion: 1, Capabilities: CapKVEvents | CapInflight | CapInflightOthers, Epoch: 10,
			KVRole: 1},
		"meta-router": {Role: RoleRouter, Name: "r1", SchemeVersion: 1, Capabilities: CapInflightOthers, Epoch: 99},
	}
}

// earlierMetas names, for the metadata goldens an earlier build wrote
// differently, the file holding its bytes: they must still decode to the
// same values (metadata without the data-parallel rank, the offload media
// or the KV role, appended).
var earlierMetas = map[string][]string{
	"meta-sidecar":       {"meta-sidecar-before-dp", "meta-sidecar-before-tiers", "meta-sidecar-before-role"},
	"meta-router":        {"meta-router-before-dp", "meta-router-before-tiers", "meta-router-before-role"},
	"meta-sidecar-dp":    {"meta-sidecar-dp-before-tiers", "meta-sidecar-dp-before-role"},
	"meta-sidecar-tiers": {"meta-sidecar-tiers-before-role"},
}

// readGolden returns the bytes of testdata/wire/name.hex.
func readGolden(t *testing.T, name string) []byte {
	t.Helper()
	path := filepath.Join("testdata", "wire", name+".hex")
	text, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b, err := hex.DecodeString(string(bytes.TrimSpace(text)))
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return b
}

// golden compares b with testdata/wire/name.hex (or writes it with -update).
func golden(t *testing.T, name string, b []byte) []byte {
	t.Helper()
	path := filepath.Join("testdata", "wire", name+".hex")
	if *updateGoldens {
		if err := os.WriteFile(path, []byte(hex.EncodeToString(b)+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want := readGolden(t, name)
	if !bytes.Equal(b, want) {
		t.Errorf("%s: encodes as\n%x\nwant\n%x", name, b, want)
	}
	return want
}

// TestWireGoldens pins the wire format: every message kind and both roles'
// metadata encode to the bytes a released build wrote, and those bytes
// decode to the same values.
func TestWireGoldens(t *testing.T) {
	for name, m := range goldenMessages() {
		want := golden(t, name, m.Append(nil))
		got, err := Decode(want)
		if err != nil || !reflect.DeepEqual(got, m) {
			t.Errorf("%s: decodes to %+v, %v; want %+v", name, got, err, m)
		}
	}
	for name, m := range goldenMetas() {
		b, dropped, err := m.Encode()
		if err != nil || dropped != 0 {
			t.Fatalf("%s: %v, %d models dropped", name, err, dropped)
		}
		want := golden(t, name, b)
		got, err := DecodeMeta(want)
		if err != nil || !reflect.DeepEqual(got, m) {
			t.Errorf("%s: decodes to %+v, %v; want %+v", name, got, err, m)
		}
		for _, earlier := range earlierMetas[name] {
			got, err := DecodeMeta(readGolden(t, earlier))
			if err != nil || !reflect.DeepEqual(got, m) {
				t.Errorf("%s: decodes to %+v, %v; want %+v", earlier, got, err, m)
			}
		}
	}
	entries, err := os.ReadDir(filepath.Join("testdata", "wire"))
	if err != nil {
		t.Fatal(err)
	}
	n := len(goldenMessages()) + len(goldenMetas())
	for _, files := range earlierMetas {
		n += len(files)
	}
	if len(entries) != n {
		t.Errorf("testdata/wire holds %d files, the test %d cases", len(entries), n)
	}
}

// TestDecodeIgnoresAppendedFields: a later version may append fields to the
// fixed-layout kinds and to metadata; this one decodes what it knows and
// ignores the rest, and still rejects every record cut short.
func TestDecodeIgnoresAppendedFields(t *testing.T) {
	later := []byte{0x05, 'l', 'a', 't', 'e', 'r', 0xff, 0x01}
	for name, m := range goldenMessages() {
		if m.Kind == KindSnapshot || m.Kind == KindDelta {
			continue // the payload is the rest: bloom's encoding, versioned itself
		}
		b := m.Append(nil)
		got, err := Decode(append(b, later...))
		if err != nil || !reflect.DeepEqual(got, m) {
			t.Errorf("%s with appended fields: %+v, %v; want %+v", name, got, err, m)
		}
		for n := range len(b) {
			if _, err := Decode(b[:n]); err == nil {
				t.Errorf("%s cut to %d of %d bytes: accepted", name, n, len(b))
			}
		}
	}
	for name, m := range goldenMetas() {
		b, _, _ := m.Encode()
		got, err := DecodeMeta(append(b, later...))
		if err != nil || !reflect.DeepEqual(got, m) {
			t.Errorf("%s with appended fields: %+v, %v; want %+v", name, got, err, m)
		}
		// Cut just before the KV role, the offload media, or the
		// data-parallel field too (one byte each for small values), it is
		// an earlier build's metadata, not a record cut short: the same
		// member without those fields.
		mediaLen := 1
		for _, md := range m.OffloadMedia {
			mediaLen += 1 + len(md)
		}
		earlier := map[int]Meta{}
		noRole := m
		noRole.KVRole = 0
		earlier[len(b)-1] = noRole
		noMedia := noRole
		noMedia.OffloadMedia = nil
		earlier[len(b)-1-mediaLen] = noMedia
		noDP := noMedia
		noDP.DataParallel, noDP.DataParallelRank = false, 0
		earlier[len(b)-1-mediaLen-1] = noDP
		for n := range len(b) {
			got, err := DecodeMeta(b[:n])
			without, isEarlier := earlier[n]
			switch {
			case isEarlier:
				if err != nil || !reflect.DeepEqual(got, without) {
					t.Errorf("%s as an earlier build wrote it: %+v, %v; want %+v", name, got, err, without)
				}
			case err == nil:
				t.Errorf("%s cut to %d of %d bytes: accepted", name, n, len(b))
			}
		}
	}
}
