package kvevents

import (
	"bytes"
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

// FuzzFrames feeds arbitrary multipart messages (frames split at 0x00 0x00)
// to the live and replay framing parsers: no panic, and what they accept
// has the shape they promise.
func FuzzFrames(f *testing.F) {
	f.Add([]byte("kv@\x00\x00\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x92\x01\x90"), "kv@")
	f.Add([]byte("\x00\x00topic\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff\x00\x00"), "")
	f.Fuzz(func(t *testing.T, raw []byte, topic string) {
		frames := bytes.Split(raw, []byte{0, 0})
		seq, payload, filtered, err := parseLive(frames, topic)
		if err == nil && !filtered {
			if len(frames) != 3 || !bytes.HasPrefix(frames[0], []byte(topic)) || !bytes.Equal(seqBytes(seq), frames[1]) || !bytes.Equal(payload, frames[2]) {
				t.Fatalf("parseLive accepted %q as seq %d", frames, seq)
			}
		}
		seq, payload, end, err := parseReplay(frames)
		if err == nil && !end && (len(payload) == 0 || seq == ^uint64(0)) {
			t.Fatalf("parseReplay returned an end marker as data: %q", frames)
		}
		parseReplayRequest(frames)
	})
}
