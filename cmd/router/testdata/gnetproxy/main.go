// Command gnetproxy is an experiment: a bare HTTP/1.1 keep-alive relay on
// gnet v2 event loops, for BenchmarkProxyVsNginx to compare with the bare
// fasthttp relay and nginx. Every client connection's request goes to an
// upstream connection registered on the same event loop, and the response
// comes back on that loop, with no goroutine handoff per request.
//
// It frames just enough HTTP for the benchmark: messages end after the
// header block plus Content-Length bytes (no chunked bodies), one request
// in flight per client connection. Requests are relayed whole once
// buffered; responses are streamed as they arrive.
package main

import (
	"bytes"
	"context"
	"flag"
	"log"
	"net"
	"runtime"
	"sync"

	"github.com/panjf2000/gnet/v2"
	"github.com/panjf2000/gnet/v2/pkg/logging"
)

var crlfcrlf = []byte("\r\n\r\n")

// loopState is owned by one event loop; only that loop's goroutine
// touches it.
type loopState struct {
	el      gnet.EventLoop
	idle    []*upConn
	waiting []*client // clients with a whole request and no upstream yet
	dialing int
}

type client struct {
	c       gnet.Conn
	ls      *loopState
	up      *upConn // upstream serving the request in flight
	pending []byte  // request copied while waiting for an upstream conn
	closed  bool
}

type upConn struct {
	c      gnet.Conn
	ls     *loopState
	cl     *client // nil when idle or when the client went away
	busy   bool
	remain int // bytes of the current response still to relay; -1 before its header
	closed bool
}

type relay struct {
	gnet.BuiltinEventEngine
	upAddr net.Addr
	loops  sync.Map // gnet.EventLoop -> *loopState
}

func (r *relay) state(el gnet.EventLoop) *loopState {
	if v, ok := r.loops.Load(el); ok {
		return v.(*loopState)
	}
	v, _ := r.loops.LoadOrStore(el, &loopState{el: el})
	return v.(*loopState)
}

func (r *relay) OnOpen(c gnet.Conn) ([]byte, gnet.Action) {
	if u, ok := c.Context().(*upConn); ok {
		// An upstream connection we registered on this loop.
		u.c = c
		u.ls.dialing--
		r.release(u)
		return nil, gnet.None
	}
	c.SetContext(&client{c: c, ls: r.state(c.EventLoop())})
	return nil, gnet.None
}

func (r *relay) OnClose(c gnet.Conn, _ error) gnet.Action {
	switch x := c.Context().(type) {
	case *client:
		x.closed = true
		if x.up != nil {
			x.up.cl = nil // the response is drained, then the conn reused
		}
		if x.pending != nil {
			ls := x.ls
			for i, w := range ls.waiting {
				if w == x {
					ls.waiting = append(ls.waiting[:i], ls.waiting[i+1:]...)
					break
				}
			}
		}
	case *upConn:
		x.closed = true
		ls := x.ls
		for i, u := range ls.idle {
			if u == x {
				ls.idle = append(ls.idle[:i], ls.idle[i+1:]...)
				break
			}
		}
		if x.cl != nil && !x.cl.closed {
			x.cl.up = nil
			_ = x.cl.c.Close()
		}
	}
	return gnet.None
}

func (r *relay) OnTraffic(c gnet.Conn) gnet.Action {
	switch x := c.Context().(type) {
	case *client:
		r.clientTraffic(x)
	case *upConn:
		return r.upTraffic(x)
	}
	return gnet.None
}

// headerEnd returns the length of the header block (with its blank line)
// and the Content-Length, or hdr < 0 if the header is not complete.
func headerEnd(buf []byte) (hdr, cl int) {
	i := bytes.Index(buf, crlfcrlf)
	if i < 0 {
		return -1, 0
	}
	h := buf[:i]
	for len(h) > 0 {
		j := bytes.IndexByte(h, '\n')
		var line []byte
		if j < 0 {
			line, h = h, nil
		} else {
			line, h = h[:j], h[j+1:]
		}
		const name = "content-length:"
		if len(line) > len(name) && bytes.EqualFold(line[:len(name)], []byte(name)) {
			v := bytes.TrimSpace(line[len(name):])
			n := 0
			for _, b := range v {
				if b < '0' || b > '9' {
					break
				}
				n = n*10 + int(b-'0')
			}
			cl = n
		}
	}
	return i + 4, cl
}

// clientTraffic relays a whole buffered request, if there is one and none
// is in flight on this client connection.
func (r *relay) clientTraffic(cl *client) {
	if cl.up != nil || cl.pending != nil || cl.closed {
		return // one request in flight; the rest waits in the inbound buffer
	}
	buf, _ := cl.c.Peek(-1)
	hdr, n := headerEnd(buf)
	if hdr < 0 || len(buf) < hdr+n {
		return
	}
	req := buf[:hdr+n]
	ls := cl.ls
	if k := len(ls.idle); k > 0 {
		u := ls.idle[k-1]
		ls.idle = ls.idle[:k-1]
		r.send(cl, u, req)
		_, _ = cl.c.Discard(len(req))
		return
	}
	cl.pending = append([]byte(nil), req...)
	_, _ = cl.c.Discard(len(req))
	ls.waiting = append(ls.waiting, cl)
	if ls.dialing < len(ls.waiting) {
		r.dial(ls)
	}
}

func (r *relay) send(cl *client, u *upConn, req []byte) {
	cl.up, u.cl, u.busy, u.remain = u, cl, true, -1
	_, _ = u.c.Write(req) // same loop: a direct write(2), buffered on EAGAIN
}

// dial registers a new upstream connection on ls's loop; OnOpen hands it
// to a waiting client.
func (r *relay) dial(ls *loopState) {
	ls.dialing++
	u := &upConn{ls: ls}
	ctx := gnet.NewContext(context.Background(), u)
	ch, err := ls.el.Register(ctx, r.upAddr)
	if err != nil {
		ls.dialing--
		r.failWaiter(ls)
		return
	}
	go func() {
		if res := <-ch; res.Err != nil {
			log.Printf("dial upstream: %v", res.Err)
			_ = ls.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
				ls.dialing--
				r.failWaiter(ls)
				return nil
			}))
		}
	}()
}

func (r *relay) failWaiter(ls *loopState) {
	if len(ls.waiting) == 0 {
		return
	}
	cl := ls.waiting[0]
	ls.waiting = ls.waiting[1:]
	cl.pending = nil
	_, _ = cl.c.Write([]byte("HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n"))
	r.clientTraffic(cl)
}

// release gives an upstream conn to a waiting client or makes it idle.
func (r *relay) release(u *upConn) {
	u.cl, u.busy = nil, false
	if u.closed {
		return
	}
	ls := u.ls
	if len(ls.waiting) > 0 {
		cl := ls.waiting[0]
		ls.waiting = ls.waiting[1:]
		req := cl.pending
		cl.pending = nil
		r.send(cl, u, req)
		return
	}
	ls.idle = append(ls.idle, u)
}

func (r *relay) upTraffic(u *upConn) gnet.Action {
	for u.busy {
		buf, _ := u.c.Peek(-1)
		if len(buf) == 0 {
			return gnet.None
		}
		if u.remain < 0 {
			hdr, n := headerEnd(buf)
			if hdr < 0 {
				return gnet.None
			}
			u.remain = hdr + n
		}
		n := min(len(buf), u.remain)
		cl := u.cl
		if cl != nil && !cl.closed {
			_, _ = cl.c.Write(buf[:n])
		}
		_, _ = u.c.Discard(n)
		u.remain -= n
		if u.remain > 0 {
			return gnet.None
		}
		if cl != nil {
			cl.up = nil
		}
		r.release(u)
		if cl != nil && !cl.closed && cl.c.InboundBuffered() > 0 {
			r.clientTraffic(cl) // a request that arrived while this one was in flight
		}
	}
	if u.c.InboundBuffered() > 0 {
		return gnet.Close // bytes outside any response
	}
	return gnet.None
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "listen address")
	upstream := flag.String("upstream", "", "upstream host:port")
	loops := flag.Int("loops", 0, "event loops (0: GOMAXPROCS)")
	lock := flag.Bool("lock-os-thread", false, "lock each event loop to an OS thread")
	reuse := flag.Bool("reuseport", false, "one listener per loop (SO_REUSEPORT) instead of a main acceptor reactor")
	flag.Parse()
	addr, err := net.ResolveTCPAddr("tcp", *upstream)
	if err != nil {
		log.Fatal(err)
	}
	n := *loops
	if n <= 0 {
		n = runtime.GOMAXPROCS(0)
	}
	r := &relay{upAddr: addr}
	log.Fatal(gnet.Run(r, "tcp://"+*listen,
		gnet.WithMulticore(true),
		gnet.WithNumEventLoop(n),
		gnet.WithLockOSThread(*lock),
		gnet.WithReusePort(*reuse),
		gnet.WithTCPNoDelay(gnet.TCPNoDelay),
		gnet.WithLogLevel(logging.WarnLevel),
	))
}
