package hangup

import "golang.org/x/sys/unix"

// peerClosed reports whether the peer of socket fd closed its side or reset
// it. POLLRDHUP sees the end of the stream even behind unread bytes: a TLS
// client's close_notify, or a request pipelined just before it left. nginx
// treats EPOLLRDHUP the same way (ngx_http_upstream_check_broken_connection).
func peerClosed(fd int) bool {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0 && fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
}
