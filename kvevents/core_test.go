package kvevents

import (
	"bytes"
	"slices"
	"testing"
)

func TestPublisherBindRule(t *testing.T) {
	for ep, binds := range map[string]bool{
		"tcp://*:5557":           true,
		"tcp://[::]:5557":        true,
		"ipc:///tmp/kv":          true,
		"inproc://kv":            true,
		"tcp://127.0.0.1:5557":   false,
		"tcp://indexer:5557":     false,
		"tcp://10.0.0.7:5557":    false,
		"tcp://[fe80::1]:5557":   true, // contains "::", as in vLLM
		"tcp://sidecar.ns:55577": false,
	} {
		if got := publisherBinds(ep); got != binds {
			t.Errorf("publisherBinds(%q) = %v, want %v", ep, got, binds)
		}
	}
}

func TestParseLive(t *testing.T) {
	seq8 := seqBytes(0x0102030405060708)
	seq, payload, filtered, err := parseLive([][]byte{[]byte("kv@a@m"), seq8, {0x90}}, "kv@")
	if err != nil || filtered || seq != 0x0102030405060708 || !bytes.Equal(payload, []byte{0x90}) {
		t.Fatalf("got %d %x %v %v", seq, payload, filtered, err)
	}
	if _, _, filtered, err := parseLive([][]byte{[]byte("other"), seq8, nil}, "kv@"); !filtered || err != nil {
		t.Fatalf("other topic: filtered=%v err=%v", filtered, err)
	}
	for _, frames := range [][][]byte{
		{[]byte("kv@"), seq8},
		{[]byte("kv@"), seq8, nil, nil},
		{[]byte("kv@"), seq8[:7], nil},
		{[]byte("kv@"), append(seq8, 0), nil},
	} {
		if _, _, _, err := parseLive(frames, "kv@"); err == nil {
			t.Errorf("parseLive(%q) accepted", frames)
		}
	}
}

func TestParseReplay(t *testing.T) {
	p := []byte{0x92, 0, 0x90}
	tests := []struct {
		name   string
		frames [][]byte
		seq    uint64
		end    bool
		bad    bool
	}{
		{"v0.26 layout", [][]byte{{}, []byte("topic"), seqBytes(7), p}, 7, false, false},
		{"v0.26 layout, empty topic", [][]byte{{}, {}, seqBytes(7), p}, 7, false, false},
		{"old layout", [][]byte{{}, seqBytes(8), p}, 8, false, false},
		{"old layout without delimiter", [][]byte{seqBytes(8), p}, 8, false, false},
		{"v0.26 end", [][]byte{{}, {}, endSeq, {}}, 0, true, false},
		{"old end", [][]byte{{}, endSeq, {}}, 0, true, false},
		{"empty payload ends", [][]byte{{}, seqBytes(3), {}}, 0, true, false},
		{"one frame", [][]byte{{}, p}, 0, false, true},
		{"short seq", [][]byte{{}, {1, 2}, p}, 0, false, true},
		{"too many frames", [][]byte{{}, {}, {}, seqBytes(1), p}, 0, false, true},
	}
	for _, tc := range tests {
		seq, payload, end, err := parseReplay(tc.frames)
		if (err != nil) != tc.bad || end != tc.end || seq != tc.seq || (!tc.bad && !tc.end && !bytes.Equal(payload, p)) {
			t.Errorf("%s: seq=%d end=%v err=%v", tc.name, seq, end, err)
		}
	}
	if _, _, ok := parseReplayRequest([][]byte{[]byte("id"), {}, seqBytes(4)}); !ok {
		t.Error("request rejected")
	}
	if _, _, ok := parseReplayRequest([][]byte{[]byte("id"), seqBytes(4)}); ok {
		t.Error("request without delimiter accepted")
	}
}

func TestSequencerVerdicts(t *testing.T) {
	var q sequencer
	step := func(seq uint64, want verdict) {
		t.Helper()
		if got := q.live(seq); got != want {
			t.Fatalf("live(%d) = %d, want %d (state %+v)", seq, got, want, q)
		}
		q.sawLive(seq)
		if want == vNext || want == vCatchUp {
			q.delivered(seq, seq)
		}
	}
	step(0, vNext)     // a fresh start at 0 needs nothing before it
	step(1, vNext)     //
	step(5, vCatchUp)  // gap 2..4
	step(6, vNext)     //
	step(6, vRestart)  // the same number again on one connection
	q.forget()         // (what the reset does)
	q2 := sequencer{}  //
	q = q2             //
	step(3, vCatchUp)  // joined mid-stream: history wanted
	q.delivered(10, 0) // a replay delivered up to 10
	step(8, vDuplicate)
	step(11, vNext)
	q.reconnected()
	if got := q.live(11); got != vRestart {
		t.Fatalf("after reconnect, seq 11 again = %d, want restart", got)
	}
	if got := q.live(12); got != vNext {
		t.Fatalf("after reconnect, seq 12 = %d, want next", got)
	}
	if from, verify := q.replayStart(); from != 11 || !verify {
		t.Fatalf("replayStart = %d %v", from, verify)
	}
	q.forget()
	if from, verify := q.replayStart(); from != 0 || verify {
		t.Fatalf("replayStart after forget = %d %v", from, verify)
	}
}

func TestRingKeepsTheLastEntries(t *testing.T) {
	var r ring
	for seq := uint64(0); seq < 10; seq++ {
		r.add(ringEntry{seq: seq}, 4)
	}
	var got []uint64
	for _, e := range r.from(0) {
		got = append(got, e.seq)
	}
	if !slices.Equal(got, []uint64{6, 7, 8, 9}) {
		t.Fatalf("ring holds %v", got)
	}
	if e := r.from(8); len(e) != 2 || e[0].seq != 8 {
		t.Fatalf("from(8) = %v", e)
	}
	if e := r.from(10); len(e) != 0 {
		t.Fatalf("from(10) = %v", e)
	}
}

func TestSequencerResumes(t *testing.T) {
	var q sequencer
	q.delivered(9, 0xabc)
	for _, tc := range []struct {
		seq, hash uint64
		trustNext bool
		want      resumption
	}{
		{9, 0xabc, false, rContinues}, // our last batch: proof
		{9, 0xabc, true, rContinues},  //
		{9, 0xdef, true, rRestarted},  // same number, other bytes
		{10, 0x1, true, rContinues},   // the next one fills the gap, on a known publisher
		{10, 0x1, false, rShort},      // but proves nothing on its own
		{11, 0x1, true, rShort},       // batch 10 is gone
		{8, 0x1, true, rShort},        // not what was asked for
	} {
		if got := q.resumes(tc.seq, tc.hash, tc.trustNext); got != tc.want {
			t.Errorf("resumes(%d, %#x, %v) = %d, want %d", tc.seq, tc.hash, tc.trustNext, got, tc.want)
		}
	}
}

// A catch-up replay right after a reconnect delivers past the last batch
// from before it; live batches up to the replay's last one then arrive too,
// and must read as duplicates, while numbers at or below the old last one
// still mean a restart.
func TestSequencerAfterCatchUpOnReconnect(t *testing.T) {
	var q sequencer
	q.delivered(4, 0)
	q.reconnected()
	for seq := uint64(5); seq <= 7; seq++ { // replayed
		q.delivered(seq, 0)
	}
	for seq, want := range map[uint64]verdict{4: vRestart, 5: vDuplicate, 7: vDuplicate, 8: vNext, 9: vCatchUp} {
		if got := q.live(seq); got != want {
			t.Errorf("live(%d) = %d, want %d", seq, got, want)
		}
	}
	q.forget() // the check reset, then replayed on
	q.delivered(12, 0)
	q.liveAfresh()
	if got := q.live(3); got != vDuplicate {
		t.Errorf("after liveAfresh, live(3) = %d, want duplicate", got)
	}
}
