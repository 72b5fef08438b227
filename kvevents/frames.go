package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
)

// Framing of vLLM's ZmqEventPublisher, shared by Subscriber and Publisher.
// Pure functions: frames in, values out.

// endSeq marks the end of a replay: -1 as a signed 8-byte big-endian int.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// errFrames is wrapped by every framing error.
var errFrames = errors.New("kvevents: malformed ZMQ message")

func seqBytes(seq uint64) []byte { return binary.BigEndian.AppendUint64(make([]byte, 0, 8), seq) }

// parseLive checks a live message [topic, seq8, payload] and its topic prefix.
// filtered reports a well-formed message for another topic.
func parseLive(frames [][]byte, topic string) (seq uint64, payload []byte, filtered bool, err error) {
	if len(frames) != 3 {
		return 0, nil, false, fmt.Errorf("%w: %d frames, want 3 (topic, seq, payload)", errFrames, len(frames))
	}
	if len(frames[1]) != 8 {
		return 0, nil, false, fmt.Errorf("%w: sequence frame of %d bytes, want 8", errFrames, len(frames[1]))
	}
	if !bytes.HasPrefix(frames[0], []byte(topic)) {
		return 0, nil, true, nil
	}
	return binary.BigEndian.Uint64(frames[1]), frames[2], false, nil
}

// parseReplay reads one reply from a replay ROUTER as a DEALER sees it: an
// empty delimiter, then [seq8, payload] (vLLM < v0.26) or [topic, seq8,
// payload] (v0.26+, vllm-project/vllm#45177). end reports the end marker:
// sequence FF×8 or an empty payload.
func parseReplay(frames [][]byte) (seq uint64, payload []byte, end bool, err error) {
	if len(frames) > 0 && len(frames[0]) == 0 {
		frames = frames[1:]
	}
	switch len(frames) {
	case 2:
	case 3:
		frames = frames[1:]
	default:
		return 0, nil, false, fmt.Errorf("%w: replay reply of %d frames, want 2 or 3 after the delimiter", errFrames, len(frames))
	}
	if len(frames[0]) != 8 {
		return 0, nil, false, fmt.Errorf("%w: replay sequence frame of %d bytes, want 8", errFrames, len(frames[0]))
	}
	if bytes.Equal(frames[0], endSeq) || len(frames[1]) == 0 {
		return 0, nil, true, nil
	}
	return binary.BigEndian.Uint64(frames[0]), frames[1], false, nil
}

// parseReplayRequest reads a request as the ROUTER sees it: [identity, "",
// start_seq8]. vLLM ignores anything else, and so does the Publisher.
func parseReplayRequest(frames [][]byte) (identity []byte, start uint64, ok bool) {
	if len(frames) != 3 || len(frames[1]) != 0 || len(frames[2]) != 8 {
		return nil, 0, false
	}
	return frames[0], binary.BigEndian.Uint64(frames[2]), true
}
