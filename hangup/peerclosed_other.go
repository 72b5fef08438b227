//go:build !linux

package hangup

import (
	"errors"
	"syscall"
)

// peerClosed reports whether the peer of socket fd closed or reset it: a
// peek that finds the end of the stream. Without Linux's POLLRDHUP, an end
// behind unread bytes (a TLS close_notify, a pipelined request) is not seen.
func peerClosed(fd int) bool {
	var b [1]byte
	n, _, err := syscall.Recvfrom(fd, b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	return n == 0 && err == nil || errors.Is(err, syscall.ECONNRESET)
}
