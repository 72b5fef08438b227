package kvevents

import (
	"encoding/binary"
	"fmt"
	"io"
)

// ZMTP 3.x framing (rfc.zeromq.org/spec/23): a 64-byte greeting, then
// frames, each a flags byte, a size (one byte, or eight big-endian with
// flagLong) and the body. A message is its frames up to one without
// flagMore; a command (the handshake's READY) is a one-frame message.
const (
	greetingLen = 64
	flagMore    = 0x01
	flagLong    = 0x02
	// frameCost is what each frame is charged on top of its body: go-zeromq
	// keeps every frame as a separate slice, so a message of many empty
	// frames costs memory too.
	frameCost = 64
)

// MessageTooLargeError is the read error for a peer whose next frame would
// take its message over the limit. It comes from the frame's header, before
// any byte of the size reaches go-zeromq (which allocates the whole declared
// size at once), and the connection is not usable after it.
type MessageTooLargeError struct {
	Frame   uint64 // size the frame declared
	Message uint64 // bytes the message would reach with it, frames charged frameCost each
	Limit   uint64
}

func (e *MessageTooLargeError) Error() string {
	return fmt.Sprintf("kvevents: ZMQ peer declared a %d-byte frame, taking its message to %d bytes, over the %d-byte limit", e.Frame, e.Message, e.Limit)
}

// Timeout and Temporary make it a net.Error that is neither, which is what
// makes go-zeromq drop the connection instead of reading on.
func (e *MessageTooLargeError) Timeout() bool   { return false }
func (e *MessageTooLargeError) Temporary() bool { return false }

// frameReader passes a ZMTP byte stream through unchanged while it keeps the
// size of each message within limit. It never reads past the end of the
// frame being passed, so it asks the peer for nothing the peer is not
// already sending. Errors are sticky: the stream is not resumable after one.
type frameReader struct {
	r        io.Reader
	limit    uint64
	greeting int     // greeting bytes not yet passed
	hdr      [9]byte // header of the current frame
	held     []byte  // checked header bytes not yet passed
	body     uint64  // body bytes of the current frame not yet passed
	last     bool    // the current frame ends its message
	charged  uint64  // the current message so far, frames charged frameCost
	messages uint64  // whole messages passed, commands included
	err      error
}

func newFrameReader(r io.Reader, limit uint64) frameReader {
	return frameReader{r: r, limit: limit, greeting: greetingLen}
}

func (f *frameReader) Read(p []byte) (int, error) {
	if f.err != nil {
		return 0, f.err
	}
	if len(p) == 0 {
		return 0, nil
	}
	if f.greeting == 0 && len(f.held) == 0 && f.body == 0 {
		if f.err = f.header(); f.err != nil {
			return 0, f.err
		}
	}
	var n int
	switch {
	case f.greeting > 0:
		n, f.err = f.r.Read(p[:min(len(p), f.greeting)])
		f.greeting -= n
		return n, f.err
	case len(f.held) > 0:
		n = copy(p, f.held)
		f.held = f.held[n:]
	default:
		n, f.err = f.r.Read(p[:min(uint64(len(p)), f.body)])
		f.body -= uint64(n)
	}
	if len(f.held) == 0 && f.body == 0 && f.last {
		f.messages++
		f.charged = 0
	}
	return n, f.err
}

// header reads the next frame's header and checks its size against the
// limit; it passes nothing on.
func (f *frameReader) header() error {
	if _, err := io.ReadFull(f.r, f.hdr[:2]); err != nil {
		return err
	}
	n, size := 2, uint64(f.hdr[1])
	if f.hdr[0]&flagLong != 0 {
		if _, err := io.ReadFull(f.r, f.hdr[2:9]); err != nil {
			return noEOF(err)
		}
		n, size = 9, binary.BigEndian.Uint64(f.hdr[1:9])
	}
	// charged <= limit, and limit is far below 2^63, so the sum cannot
	// overflow once size <= limit.
	if size > f.limit || f.charged+size+frameCost > f.limit {
		return &MessageTooLargeError{Frame: size, Message: satAdd(satAdd(f.charged, size), frameCost), Limit: f.limit}
	}
	f.charged += size + frameCost
	f.held, f.body, f.last = f.hdr[:n], size, f.hdr[0]&flagMore == 0
	return nil
}

// noEOF turns an end of stream inside a header into the truncation it is.
func noEOF(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

func satAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint64(0)
}
