package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/certfile"
	"github.com/kvmesh/kvmesh/memberflags"
)

func TestHelpListsContractFlagsAndEnv(t *testing.T) {
	out, _ := exec.Command(routerBinary(t), "-h").CombinedOutput()
	for _, f := range []string{"-listen", "-gossip-bind", "-gossip-advertise", "-join", "-gossip-key", "-policy",
		"-tokenizer", "-config", "-admin-token", "-max-body-bytes", "-log-format", "-log-level",
		"KVMESH_LISTEN", "KVMESH_MAX_BODY_BYTES", "KVMESH_STATIC_UPSTREAM"} {
		if !strings.Contains(string(out), f) {
			t.Errorf("-h lacks %s", f)
		}
	}
	if err := exec.Command(routerBinary(t), "--policy", "fastest").Run(); err == nil {
		t.Error("unknown policy accepted")
	}
	if out, err := exec.Command(routerBinary(t), "--version").Output(); err != nil || !strings.HasPrefix(string(out), "router ") {
		t.Errorf("--version: %q, %v; want \"router <build>\" and exit 0", out, err)
	}
}

// TestSharedFlagsMatchTheSidecars: every flag memberflags registers reads
// the same in `router -h` and `sidecar -h` (name, type, help, variable,
// default), but for --gossip-bind's default: a sidecar always gossips, a
// router only when asked.
func TestSharedFlagsMatchTheSidecars(t *testing.T) {
	shared := flag.NewFlagSet("shared", flag.ContinueOnError)
	new(memberflags.Flags).Register(shared, "")
	var names []string
	shared.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	for _, want := range []string{"gossip-bind", "gossip-advertise", "join", "gossip-key", "gossip-label",
		"gossip-trust-sender", "engine-api-key", "log-format", "log-level"} {
		if !slices.Contains(names, want) {
			t.Errorf("--%s is not among the shared flags %v", want, names)
		}
	}
	routerHelp, sidecarHelp := helpEntries(t, routerBinary(t)), helpEntries(t, sidecarBuild.binary(t))
	for _, name := range names {
		r, s := routerHelp[name], sidecarHelp[name]
		if name == "gossip-bind" {
			if !strings.HasSuffix(s, ` (default "0.0.0.0:7946")`) || strings.Contains(r, "(default") {
				t.Errorf("--gossip-bind defaults: router %q, sidecar %q; want none and 0.0.0.0:7946", r, s)
			}
			s = strings.TrimSuffix(s, ` (default "0.0.0.0:7946")`)
		}
		if r == "" || r != s {
			t.Errorf("--%s differs:\n router  %q\n sidecar %q", name, r, s)
		}
	}
	if !strings.Contains(routerHelp["gossip-label"], `(env KVMESH_GOSSIP_LABEL) (default "kvmesh")`) {
		t.Errorf("--gossip-label: %q", routerHelp["gossip-label"])
	}
}

// helpEntries runs bin -h and returns each flag's entry (the lines from
// "-name type" up to the next flag, joined by spaces) by name.
func helpEntries(t *testing.T, bin string) map[string]string {
	out, _ := exec.Command(bin, "-h").CombinedOutput()
	entries := map[string]string{}
	name := ""
	for _, line := range strings.Split(string(out), "\n") {
		if rest, ok := strings.CutPrefix(line, "  -"); ok {
			name, _, _ = strings.Cut(rest, " ")
			entries[name] = strings.TrimSpace(rest)
			continue
		}
		if text := strings.TrimSpace(line); name != "" && text != "" {
			entries[name] += " " + text
		}
	}
	if len(entries) < 10 {
		t.Fatalf("%s -h lists %d flags:\n%s", bin, len(entries), out)
	}
	return entries
}

// TestSIGTERMDrainsInflightStream: a stream in flight when SIGTERM arrives
// runs to [DONE]; the router stops accepting and exits cleanly.
func TestSIGTERMDrainsInflightStream(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	engine := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("text/event-stream")
		ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
			for i := range 20 {
				fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"%d\"}}]}\n\n", i)
				if w.Flush() != nil {
					return
				}
				time.Sleep(40 * time.Millisecond)
			}
			fmt.Fprint(w, "data: [DONE]\n\n")
			_ = w.Flush()
		})
	}}
	go func() { _ = engine.Serve(ln) }()
	defer engine.Shutdown()

	addr := freeAddr(t)
	cmd := start(t, nil, routerBinary(t), "--listen", addr, "--static-upstream", "e=http://"+ln.Addr().String()+",m",
		"--tokenizer", "*=builtin", "--drain-timeout", "5s", "--log-level", "warn")
	waitListening(t, addr)

	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	br := bufio.NewReader(c)
	got := make(chan string, 1)
	go func() {
		var sb strings.Builder
		for {
			line, err := br.ReadString('\n')
			sb.WriteString(line)
			if err != nil || strings.HasPrefix(line, "data: [DONE]") {
				got <- sb.String()
				return
			}
		}
	}()
	time.Sleep(200 * time.Millisecond)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-got:
		if !strings.Contains(s, "X-Kvmesh-Replica: e") || !strings.Contains(s, `"content":"19"`) || !strings.Contains(s, "data: [DONE]") {
			t.Fatalf("stream cut by shutdown:\n%s", s)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("stream did not finish")
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("router exit: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("router did not exit after draining")
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Fatal("router still accepts connections after shutdown")
	}
}

// TestShutdownDelayStopsReadinessFirst: with --shutdown-delay, SIGTERM turns
// /ready to 503 at once while requests are still served for the delay; then
// the router drains and exits.
func TestShutdownDelayStopsReadinessFirst(t *testing.T) {
	engine := upstream(t)
	addr := freeAddr(t)
	cmd := start(t, nil, routerBinary(t), "--listen", addr, "--static-upstream", "e=http://"+engine+",bench",
		"--tokenizer", "*=builtin", "--shutdown-delay", "1s", "--log-level", "warn")
	waitListening(t, addr)
	get := func(path string) int {
		status, _, err := fasthttp.GetTimeout(nil, "http://"+addr+path, 2*time.Second)
		if err != nil {
			return 0
		}
		return status
	}
	if s := get("/ready"); s != 200 {
		t.Fatalf("/ready before shutdown: %d", s)
	}
	signalled := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if s := get("/ready"); s != 503 {
		t.Errorf("/ready during the shutdown delay: %d, want 503", s)
	}
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI("http://" + addr + "/v1/completions")
	req.Header.SetMethod("POST")
	req.SetBodyString(`{"model":"bench","prompt":"hello","max_tokens":1}`)
	if err := fasthttp.DoTimeout(req, resp, 2*time.Second); err != nil || resp.StatusCode() != 200 {
		t.Errorf("a request during the shutdown delay: %v %d", err, resp.StatusCode())
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		if took := time.Since(signalled); err != nil || took < time.Second {
			t.Fatalf("router exit after %v: %v (want ≥ the 1 s delay, clean)", took, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("router did not exit")
	}
}

// TestGossipRouterStartsAndLeaves: with --gossip-bind the router joins (a
// cluster of one), serves, reports not ready without replicas, and leaves
// on SIGTERM.
func TestGossipRouterStartsAndLeaves(t *testing.T) {
	addr := freeAddr(t)
	cmd := start(t, nil, routerBinary(t), "--listen", addr, "--gossip-bind", "127.0.0.1:0", "--name", "r1",
		"--gossip-key", "MDEyMzQ1Njc4OWFiY2RlZg==", "--log-level", "warn")
	waitListening(t, addr)
	status, body, err := fasthttp.Get(nil, "http://"+addr+"/ready")
	if err != nil || status != 503 {
		t.Fatalf("ready with no replica: %d %s %v", status, body, err)
	}
	status, body, _ = fasthttp.Get(nil, "http://"+addr+"/metrics")
	if status != 200 || !strings.Contains(string(body), "kvmesh_router_routes_total{mode=\"prefix\"} 0") {
		t.Fatalf("metrics: %d", status)
	}
	for _, line := range []string{"kvmesh_router_gossip_members 1", `kvmesh_router_gossip_rejected_total{reason="decrypt"} 0`,
		`kvmesh_router_gossip_received_messages_total{kind="load"} 0`} {
		if !strings.Contains(string(body), line) {
			t.Errorf("metrics lack %q", line)
		}
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit: %v", err)
		}
	case <-time.After(8 * time.Second):
		t.Fatal("router did not leave and exit")
	}
}

// TestGossipLabelKeepsClustersApart: a sidecar started with --gossip-label
// prod joins a router started with the same label and is refused by one
// left at the default, which counts the rejection.
func TestGossipLabelKeepsClustersApart(t *testing.T) {
	const key = "MDEyMzQ1Njc4OWFiY2RlZg=="
	prodAPI, prodGossip, defaultAPI, defaultGossip := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	start(t, nil, routerBinary(t), "--listen", prodAPI, "--gossip-bind", prodGossip, "--name", "r-prod",
		"--gossip-key", key, "--gossip-label", "prod", "--log-level", "warn")
	start(t, nil, routerBinary(t), "--listen", defaultAPI, "--gossip-bind", defaultGossip, "--name", "r-default",
		"--gossip-key", key, "--log-level", "error")
	waitListening(t, prodAPI)
	waitListening(t, defaultAPI)
	start(t, nil, sidecarBuild.binary(t), "--name", "replica-prod", "--engine", "http://"+freeAddr(t),
		"--kv-events", "tcp://"+freeAddr(t), "--listen", freeAddr(t), "--gossip-bind", freeAddr(t),
		"--join", prodGossip+","+defaultGossip, "--gossip-key", key, "--gossip-label", "prod", "--log-level", "error")
	get := func(addr, path string) string {
		_, body, _ := fasthttp.GetTimeout(nil, "http://"+addr+path, 2*time.Second)
		return string(body)
	}
	deadline := time.Now().Add(15 * time.Second)
	for !strings.Contains(get(prodAPI, "/admin/replicas"), `"replica-prod"`) {
		if time.Now().After(deadline) {
			t.Fatalf("the prod router never listed the prod sidecar: %s", get(prodAPI, "/admin/replicas"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	for !strings.Contains(get(defaultAPI, "/metrics"), `kvmesh_router_gossip_rejected_total{reason="label"} `) ||
		strings.Contains(get(defaultAPI, "/metrics"), `kvmesh_router_gossip_rejected_total{reason="label"} 0`) {
		if time.Now().After(deadline) {
			t.Fatal("the default-label router counted no rejected label")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if reps := get(defaultAPI, "/admin/replicas"); strings.Contains(reps, "replica-prod") {
		t.Fatalf("the default-label router took a prod member: %s", reps)
	}
}

// TestServesHTTPSWithRenewedCertificate: with --tls-cert/--tls-key the
// router speaks HTTPS only, and a certificate renewed in place is served
// to new connections without a restart.
func TestServesHTTPSWithRenewedCertificate(t *testing.T) {
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	writeCert := func() *x509.CertPool {
		certPEM, keyPEM, err := certfile.SelfSigned([]string{"127.0.0.1"}, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(certPath, certPEM, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(keyPath, keyPEM, 0o600); err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(certPEM)
		return pool
	}
	first := writeCert()
	addr := freeAddr(t)
	start(t, nil, routerBinary(t), "--listen", addr, "--tls-cert", certPath, "--tls-key", keyPath, "--log-level", "warn")
	waitListening(t, addr)
	get := func(roots *x509.CertPool) error {
		c := &fasthttp.Client{TLSConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}
		status, _, err := c.GetTimeout(nil, "https://"+addr+"/health", 5*time.Second)
		if err == nil && status != 200 {
			err = fmt.Errorf("status %d", status)
		}
		return err
	}
	if err := get(first); err != nil {
		t.Fatalf("https with the first certificate: %v", err)
	}
	if status, _, err := fasthttp.GetTimeout(nil, "http://"+addr+"/health", 2*time.Second); err == nil && status == 200 {
		t.Fatal("plain HTTP answered on a TLS listener")
	}
	// Renewed in place (a new mtime on most filesystems; make sure).
	second := writeCert()
	later := time.Now().Add(time.Minute)
	_ = os.Chtimes(certPath, later, later)
	_ = os.Chtimes(keyPath, later, later)
	deadline := time.Now().Add(15 * time.Second)
	for get(second) != nil {
		if time.Now().After(deadline) {
			t.Fatal("the renewed certificate was not served within 15 s")
		}
		time.Sleep(250 * time.Millisecond)
	}
	if err := exec.Command(routerBinary(t), "--tls-cert", certPath).Run(); err == nil {
		t.Error("--tls-cert without --tls-key accepted")
	}
}

// TestRootsWithoutSystemCertificates: in the FROM scratch image there are no
// system certificates; the router still has roots to verify an https
// upstream (a hosted fallback) with. The check runs in a child process that
// sees no certificate files.
func TestRootsWithoutSystemCertificates(t *testing.T) {
	if os.Getenv("KVMESH_TEST_ROOTS_CHILD") == "1" {
		pool, err := x509.SystemCertPool()
		if err != nil || pool.Equal(x509.NewCertPool()) {
			fmt.Println("no roots:", err)
			os.Exit(1)
		}
		fmt.Println("roots present")
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^TestRootsWithoutSystemCertificates$")
	cmd.Env = append(os.Environ(), "KVMESH_TEST_ROOTS_CHILD=1", "SSL_CERT_FILE=/nonexistent", "SSL_CERT_DIR=/nonexistent")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "roots present") {
		t.Fatalf("without system certificates: %v\n%s", err, out)
	}
}
