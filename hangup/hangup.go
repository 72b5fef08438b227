// Package hangup tells a server whether the client of a connection has gone,
// without reading from it. fasthttp tells a handler nothing of its client
// until it writes, and a request waiting on an engine writes nothing: the
// router (gateway's client watch) and enginesim (a non-streamed completion)
// poll with Gone to abort work nobody waits for any more.
package hangup

import (
	"net"
	"syscall"
)

// Gone reports whether the peer of conn hung up, without consuming
// anything. Over TLS the raw socket is what is looked at. A connection that
// is no socket is never gone.
func Gone(conn net.Conn) bool {
	if tc, ok := conn.(interface{ NetConn() net.Conn }); ok { // *tls.Conn
		conn = tc.NetConn()
	}
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	gone := false
	_ = rc.Control(func(fd uintptr) { gone = peerClosed(int(fd)) })
	return gone
}
