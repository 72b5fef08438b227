package proxy

import (
	"bytes"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
)

// An engine stops generating when the connection of a request it is
// working on closes. A relayed stream closes it as soon as a write to the
// client fails, but nothing is written while the engine queues and
// prefills, and a non-streamed request gives no signal at all while the
// engine works (fasthttp's client waits for the answer whole and takes no
// cancellation). An Abort carries the signal. For a non-streamed request
// the upstream connection is found through a tag header the dispatch adds
// and the connection reads back as the request leaves, and Now makes the
// waiting read fail; for a stream, Now closes the body being relayed.

// Abort ends a request's attempts early, from any goroutine (the caller saw
// its client leave). Set one in Request.Abort.
type Abort struct {
	mu      sync.Mutex
	aborted bool
	id      uint64                       // the attempt in flight, 0 between attempts
	conn    *deadlineConn                // its connection, once the request was written
	body    fasthttp.ReadCloserWithError // a stream being relayed
}

// Now closes the upstream connection of the attempt in flight, if any, and
// stops further attempts.
func (a *Abort) Now() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.aborted = true
	if a.conn != nil {
		a.conn.abort(a.id)
	}
	if a.body != nil {
		_ = a.body.CloseWithError(errAborted)
	}
}

// relaying lets Now close body, a stream's, until the returned end is
// called; an Abort already done closes it at once.
func (a *Abort) relaying(body fasthttp.ReadCloserWithError) (end func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.aborted {
		_ = body.CloseWithError(errAborted)
	}
	a.body = body
	return func() {
		a.mu.Lock()
		a.body = nil
		a.mu.Unlock()
	}
}

// Aborted reports whether Now was called.
func (a *Abort) Aborted() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.aborted
}

func (a *Abort) begin(id uint64) {
	a.mu.Lock()
	a.id, a.conn = id, nil
	a.mu.Unlock()
}

func (a *Abort) end() {
	a.mu.Lock()
	a.id, a.conn = 0, nil
	a.mu.Unlock()
}

// attach is called by the connection the attempt id was written to.
func (a *Abort) attach(id uint64, c *deadlineConn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.id != id {
		return
	}
	a.conn = c
	if a.aborted {
		c.abort(id)
	}
}

// headerRequestTag names the tag header; engines ignore it.
const headerRequestTag = "X-Kvmesh-Request"

var (
	requestTags     atomic.Uint64
	requestTagBytes = []byte("\r\n" + headerRequestTag + ": ")
	errAborted      = errors.New("proxy: request aborted (client gone)")
)

// watched is the registry of an upstream's abortable attempts by tag.
type watched struct {
	n  atomic.Int64 // entries, so connections skip the scan when none
	mu sync.Mutex
	m  map[uint64]*Abort
}

func (w *watched) add(id uint64, a *Abort) {
	w.mu.Lock()
	if w.m == nil {
		w.m = map[uint64]*Abort{}
	}
	w.m[id] = a
	w.mu.Unlock()
	w.n.Add(1)
}

func (w *watched) remove(id uint64) {
	w.mu.Lock()
	delete(w.m, id)
	w.mu.Unlock()
	w.n.Add(-1)
}

// noteWrite is called with the start of every request a connection
// writes: a tagged one is attached to its Abort.
func (w *watched) noteWrite(c *deadlineConn, p []byte) {
	if c.owner.Load() != 0 {
		c.setOwner(0)
	}
	if w.n.Load() == 0 || !bytes.HasPrefix(p, []byte("POST ")) {
		return
	}
	head := p[:min(len(p), 8<<10)]
	if end := bytes.Index(head, []byte("\r\n\r\n")); end >= 0 {
		head = head[:end+2]
	}
	i := bytes.Index(head, requestTagBytes)
	if i < 0 {
		return
	}
	v := head[i+len(requestTagBytes):]
	if j := bytes.IndexByte(v, '\r'); j >= 0 {
		v = v[:j]
	}
	id, err := strconv.ParseUint(string(v), 10, 64)
	if err != nil {
		return
	}
	c.setOwner(id)
	w.mu.Lock()
	a := w.m[id]
	w.mu.Unlock()
	if a != nil {
		a.attach(id, c)
	}
}

// setOwner changes the request the connection carries. It waits for an
// abort in progress: one that found the old owner must not cut the next
// request's read.
func (c *deadlineConn) setOwner(id uint64) {
	c.ownerMu.Lock()
	c.owner.Store(id)
	c.ownerMu.Unlock()
}

// abort makes the connection's pending and next reads fail, if it still
// carries request id.
func (c *deadlineConn) abort(id uint64) {
	c.ownerMu.Lock()
	defer c.ownerMu.Unlock()
	if c.owner.Load() != id {
		return
	}
	c.aborted.Store(id)
	_ = c.Conn.SetReadDeadline(time.Unix(1, 0))
}
