package hangup

import (
	"crypto/tls"
	"net"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/certfile"
)

// TestGone: a socket counts as left when its peer closed it, even
// behind bytes the server has not read (a TLS close_notify, a pipelined
// request); a peer still there, idle or having pipelined, has not left.
func TestGone(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	pair := func(t *testing.T) (client, server net.Conn) {
		t.Helper()
		client, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		server, err = ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = client.Close(); _ = server.Close() })
		return client, server
	}
	settle := func() { time.Sleep(50 * time.Millisecond) } // the close crosses loopback
	t.Run("idle", func(t *testing.T) {
		_, server := pair(t)
		settle()
		if Gone(server) {
			t.Error("an idle client counted as gone")
		}
	})
	t.Run("pipelined", func(t *testing.T) {
		client, server := pair(t)
		_, _ = client.Write([]byte("GET /health HTTP/1.1\r\n"))
		settle()
		if Gone(server) {
			t.Error("a client with its next request in flight counted as gone")
		}
	})
	t.Run("closed", func(t *testing.T) {
		client, server := pair(t)
		_ = client.Close()
		settle()
		if !Gone(server) {
			t.Error("a closed client not noticed")
		}
	})
	t.Run("closed behind unread bytes", func(t *testing.T) {
		client, server := pair(t)
		_, _ = client.Write([]byte("GET /health HTTP/1.1\r\n"))
		_ = client.Close()
		settle()
		if !Gone(server) {
			t.Error("a client that closed after sending more bytes not noticed")
		}
	})
	t.Run("tls close_notify", func(t *testing.T) {
		certPEM, keyPEM, err := certfile.SelfSigned([]string{"127.0.0.1"}, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		client, server := pair(t)
		tlsServer := tls.Server(server, &tls.Config{Certificates: []tls.Certificate{cert}})
		tlsClient := tls.Client(client, &tls.Config{InsecureSkipVerify: true})
		done := make(chan error, 1)
		go func() { done <- tlsServer.Handshake() }()
		if err := tlsClient.Handshake(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		settle()
		if Gone(tlsServer) {
			t.Error("a TLS client still there counted as gone")
		}
		_ = tlsClient.Close() // close_notify, then FIN
		settle()
		if !Gone(tlsServer) {
			t.Error("a TLS client that sent close_notify and closed not noticed")
		}
	})
}
