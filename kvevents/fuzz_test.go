package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"testing"
)

// FuzzDecodeBatch: decoding never panics, a Batch reused from an earlier
// decode gives what a fresh one does, and whatever decodes survives a
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
		var b, reused Batch
		err := DecodeBatch(payload, &b)
		_ = DecodeBatch(exampleArrayWire, &reused)
		if errAgain := DecodeBatch(payload, &reused); (err == nil) != (errAgain == nil) || err == nil && !batchEqual(&b, &reused) {
			t.Fatalf("a reused batch decodes differently: %v / %v\n got %+v\nwant %+v", errAgain, err, reused, b)
		}
		if err != nil {
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

// FuzzFrameReader feeds arbitrary byte streams, read in chunks of every
// size, through the ZMTP frame guard: it passes exactly the bytes a
// reference reading of the stream allows, never a header over the limit,
// and counts the same whole messages.
func FuzzFrameReader(f *testing.F) {
	greeting := nullGreeting[:]
	f.Add(uint16(4096), append(greeting, readyCommand("PUB")...))
	f.Add(uint16(4096), append(append(greeting, readyCommand("PUB")...), longFrameHeader(1<<50)...))
	f.Add(uint16(200), append(greeting, 0x01, 3, 'a', 'b', 'c', 0x01, 0, 0x02, 0, 0, 0, 0, 0, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9))
	f.Add(uint16(64), append(greeting, 0x01, 0, 0x01, 0))
	f.Fuzz(func(t *testing.T, limit uint16, in []byte) {
		wantN, wantTooLarge, wantMessages := referenceFrames(in, uint64(limit))
		fr := newFrameReader(bytes.NewReader(in), uint64(limit))
		var out []byte
		var err error
		for i := 0; err == nil; i++ {
			buf := make([]byte, []int{1, 3, 2, 9, 64, 7, 1000}[i%7])
			var n int
			n, err = fr.Read(buf)
			out = append(out, buf[:n]...)
		}
		var tooLarge *MessageTooLargeError
		if !bytes.Equal(out, in[:wantN]) || errors.As(err, &tooLarge) != wantTooLarge || fr.messages != wantMessages {
			t.Fatalf("limit %d: passed %d bytes (err %v, %d messages), want %d (too large %v, %d messages)",
				limit, len(out), err, fr.messages, wantN, wantTooLarge, wantMessages)
		}
		if !wantTooLarge && err != io.EOF && err != io.ErrUnexpectedEOF {
			t.Fatalf("error %v at the end of the stream", err)
		}
	})
}

// referenceFrames reads a ZMTP stream the plain way: how many bytes pass
// before a header that is cut short or takes its message over limit
// (tooLarge), and how many messages complete.
func referenceFrames(in []byte, limit uint64) (passed int, tooLarge bool, messages uint64) {
	if len(in) <= greetingLen {
		return len(in), false, 0
	}
	off, charged := greetingLen, uint64(0)
	for off < len(in) {
		hdr := 2
		if in[off]&flagLong != 0 {
			hdr = 9
		}
		if len(in)-off < hdr {
			return off, false, messages
		}
		size := uint64(in[off+1])
		if hdr == 9 {
			size = binary.BigEndian.Uint64(in[off+1 : off+9])
		}
		if size >= limit || charged+size+frameCost > limit {
			return off, true, messages
		}
		charged += size + frameCost
		if size > uint64(len(in)-off-hdr) {
			return len(in), false, messages
		}
		off += hdr + int(size)
		if in[off-hdr-int(size)]&flagMore == 0 {
			messages, charged = messages+1, 0
		}
	}
	return off, false, messages
}
