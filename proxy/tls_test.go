package proxy

import (
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/certfile"
)

// engineCert is made once per process: the first verification loads the
// trusted roots for good, so a second run of the test (-count) must present
// the same certificate.
var engineCert = sync.OnceValue(func() (c struct{ certPEM, keyPEM []byte }) {
	var err error
	if c.certPEM, c.keyPEM, err = certfile.SelfSigned([]string{"127.0.0.1"}, time.Hour); err != nil {
		panic(err)
	}
	return c
})

// TestHTTPSUpstreams: an https engine answers through the proxy, and a
// client that leaves ends its non-streamed request there as over plain
// HTTP. (The tag that finds the connection to cut is read off the wire:
// with TLS wrapped around the connection the proxy watches, it saw only
// ciphertext and no abort ever reached an https engine.)
//
// The engines' self-signed certificate is trusted through SSL_CERT_FILE,
// which Go reads once per process: this must be the package's first test
// to verify a certificate.
func TestHTTPSUpstreams(t *testing.T) {
	certPEM, keyPEM := engineCert().certPEM, engineCert().keyPEM
	roots := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(roots, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SSL_CERT_FILE", roots)
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	listenTLS := func() net.Listener {
		ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ln.Close() })
		return ln
	}
	f := &Forwarder{Log: zerolog.Nop()}

	answering := listenTLS()
	go func() { _ = (&fasthttp.Server{Handler: jsonEngine}).Serve(answering) }()
	targets := upstreams(t, "https://"+answering.Addr().String())
	url := serve(t, func(ctx *fasthttp.RequestCtx) {
		f.Forward(ctx, &Request{Path: "/v1/completions", Header: &ctx.Request.Header, Body: []byte(`{"prompt":"x","max_tokens":1}`)}, targets, newRecorder())
	})
	status, body, err := fasthttp.Post(nil, url+"/v1/completions", nil)
	if err != nil || status != 200 || !strings.Contains(string(body), "cached_tokens") {
		t.Fatalf("https engine: %d %v %s", status, err, body)
	}

	working := listenTLS()
	_, closed := workingEngine(working)
	targets = upstreams(t, "https://"+working.Addr().String())
	aborts := make(chan *Abort, 1)
	url = serve(t, func(ctx *fasthttp.RequestCtx) {
		a := &Abort{}
		aborts <- a
		f.Forward(ctx, &Request{Path: "/v1/completions", Header: &ctx.Request.Header, Body: []byte(`{"prompt":"x","max_tokens":500}`), Abort: a}, targets, newRecorder())
	})
	go func() { _, _, _ = fasthttp.Post(nil, url+"/v1/completions", nil) }()
	a := <-aborts
	time.Sleep(300 * time.Millisecond) // handshake done, request written
	a.Now()
	select {
	case <-closed:
	case <-time.After(2 * time.Second):
		t.Fatal("https engine: its connection stayed open after the abort")
	}
}
