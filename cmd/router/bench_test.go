package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	// testdata/gnetproxy, built by BenchmarkProxyVsNginx, needs gnet in
	// go.mod; go mod tidy does not look into testdata.
	_ "github.com/panjf2000/gnet/v2"
)

// The proxy benchmark compares the router with nginx as a plain keep-alive
// reverse proxy in front of the same upstream, side by side in one run:
// rounds alternate between the two so that noise from other tenants of the
// machine hits both alike. `make bench-proxy` runs it.

const benchCompletion = `{"id":"cmpl-1","object":"text_completion","created":1,"model":"bench","choices":[{"index":0,"text":" world","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0}}}`

// upstream serves a fixed small completion, as a warm engine answering a
// one-token request would.
func upstream(tb testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("application/json")
		ctx.SetBodyString(benchCompletion)
	}}
	go func() { _ = srv.Serve(ln) }()
	tb.Cleanup(func() { _ = srv.Shutdown() })
	return ln.Addr().String()
}

func freeAddr(tb testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// A built is a binary the tests build once: the router, or the bare relay
// the proxy benchmark compares it with.
type built struct {
	pkg, name string
	once      sync.Once
	path      string
	err       error
}

var (
	routerBuild  = &built{pkg: ".", name: "router"}
	sidecarBuild = &built{pkg: "../sidecar", name: "sidecar"}
	bareBuild    = &built{pkg: "./testdata/bareproxy", name: "bareproxy"}
	gnetBuild    = &built{pkg: "./testdata/gnetproxy", name: "gnetproxy"}
)

// binary builds b once for this test binary (static, as deployed).
func (b *built) binary(tb testing.TB) string {
	b.once.Do(func() {
		dir, err := os.MkdirTemp("", "kvmesh-"+b.name+"-test-")
		if err != nil {
			b.err = err
			return
		}
		b.path = filepath.Join(dir, b.name)
		cmd := exec.Command("go", "build", "-o", b.path, b.pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("building %s: %v\n%s", b.name, err, out)
		}
	})
	if b.err != nil {
		tb.Fatal(b.err)
	}
	return b.path
}

// routerBinary returns KVMESH_BENCH_ROUTER_BIN or the router built once
// for this test binary.
func routerBinary(tb testing.TB) string {
	if p := os.Getenv("KVMESH_BENCH_ROUTER_BIN"); p != "" {
		return p
	}
	return routerBuild.binary(tb)
}

// TestMain removes the binaries built for the tests.
func TestMain(m *testing.M) {
	code := m.Run()
	for _, b := range []*built{routerBuild, sidecarBuild, bareBuild, gnetBuild} {
		if b.path != "" {
			_ = os.RemoveAll(filepath.Dir(b.path))
		}
	}
	os.Exit(code)
}

// start runs a process until the test ends, killing its process group.
// env is added to this process's environment.
func start(tb testing.TB, env []string, name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
	return cmd
}

func waitListening(tb testing.TB, addr string) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("tcp", addr); err == nil {
			_ = c.Close()
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	tb.Fatalf("nothing listens on %s", addr)
}

func startNginx(tb testing.TB, up string) (string, int, bool) {
	bin, err := exec.LookPath("nginx")
	if err != nil {
		for _, p := range []string{"/usr/sbin/nginx", "/usr/local/sbin/nginx"} {
			if _, err := os.Stat(p); err == nil {
				bin = p
			}
		}
	}
	if bin == "" {
		return "", 0, false
	}
	dir := tb.TempDir()
	addr := freeAddr(tb)
	conf := fmt.Sprintf(`worker_processes auto;
daemon off;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path %[1]s/body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
  upstream engine { server %[2]s; keepalive 256; }
  server {
    listen %[3]s;
    client_max_body_size 64m;
    location / {
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
`, dir, up, addr)
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		tb.Fatal(err)
	}
	cmd := start(tb, nil, bin, "-c", path, "-p", dir)
	waitListening(tb, addr)
	return addr, cmd.Process.Pid, true
}

type loadResult struct {
	cpu      time.Duration // CPU time the proxy's processes used
	self     time.Duration // CPU time of this process (client and upstream)
	requests int64
	failed   int64
	elapsed  time.Duration
	lat      []time.Duration
}

// load sends small non-streamed completions over conns keep-alive
// connections for d.
func load(addr string, conns int, d time.Duration) loadResult {
	hc := &fasthttp.HostClient{Addr: addr, MaxConns: conns}
	body := []byte(`{"model":"bench","prompt":"hello world","max_tokens":1}`)
	var n, failed atomic.Int64
	lats := make([][]time.Duration, conns)
	var wg sync.WaitGroup
	stop := time.Now().Add(d)
	t0 := time.Now()
	for w := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
			defer fasthttp.ReleaseRequest(req)
			defer fasthttp.ReleaseResponse(resp)
			for time.Now().Before(stop) {
				req.Reset()
				req.SetRequestURI("http://" + addr + "/v1/completions")
				req.Header.SetMethod("POST")
				req.Header.SetContentType("application/json")
				req.SetBodyRaw(body)
				s := time.Now()
				if err := hc.DoTimeout(req, resp, 5*time.Second); err != nil || resp.StatusCode() != 200 {
					failed.Add(1)
					continue
				}
				lats[w] = append(lats[w], time.Since(s))
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	r := loadResult{requests: n.Load(), failed: failed.Load(), elapsed: time.Since(t0)}
	for _, l := range lats {
		r.lat = append(r.lat, l...)
	}
	return r
}

func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	return d[int(q*float64(len(d)-1))]
}

// selfCPU is the CPU time this process used: the load's client and the
// upstream, whose cost per request differs with the proxy in between.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// groupCPU sums user+system CPU time of every process in process group pg
// (nginx's master and workers; the router alone), from /proc.
func groupCPU(pg int) time.Duration {
	entries, _ := os.ReadDir("/proc")
	var ticks int64
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// Fields after the parenthesised command: state ppid pgrp ... utime(14) stime(15).
		i := bytes.LastIndexByte(stat, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(stat[i+1:]))
		if len(f) < 13 {
			continue
		}
		if g, _ := strconv.Atoi(f[2]); g != pg {
			continue
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		s, _ := strconv.ParseInt(f[12], 10, 64)
		ticks += u + s
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

// BenchmarkProxyVsNginx reports requests/s, CPU per request and latency of
// the router, of a bare fasthttp relay (testdata/bareproxy: the floor a Go
// fasthttp proxy starts from), of a bare relay on gnet's event loops
// (testdata/gnetproxy: what a Go relay gains without a goroutine park per
// request) and of nginx over the same upstream, and each one's ratio to
// nginx. The *-rest-µs/req figures are what
// the load's client and the upstream (this process) spend per request
// behind each proxy: on a machine the three share, requests/s follows the
// sum of both CPU figures. Each b.N iteration is one round of all four; set KVMESH_BENCH_ROUND (default 2s) and KVMESH_BENCH_CONNS
// (default 64).
func BenchmarkProxyVsNginx(b *testing.B) {
	up := upstream(b)
	nginx, nginxPG, ok := startNginx(b, up)
	if !ok {
		b.Skip("nginx not installed (apt-get install -y nginx-light)")
	}
	routerAddr, pprofAddr, bareAddr, gnetAddr := freeAddr(b), freeAddr(b), freeAddr(b), freeAddr(b)
	// KVMESH_BENCH_PROXY_ENV (e.g. "GOMAXPROCS=1 GODEBUG=...") is given to
	// the router and the bare relays, for experiments.
	env := strings.Fields(os.Getenv("KVMESH_BENCH_PROXY_ENV"))
	routerCmd := start(b, env, routerBinary(b), "--listen", routerAddr, "--static-upstream", "engine=http://"+up+",bench",
		"--tokenizer", "*=builtin", "--log-level", "warn", "--pprof-listen", pprofAddr)
	bareCmd := start(b, env, bareBuild.binary(b), "--listen", bareAddr, "--upstream", up)
	// KVMESH_BENCH_GNET_ARGS (e.g. "--loops 1 --lock-os-thread") is given
	// to the gnet relay.
	gnetCmd := start(b, env, gnetBuild.binary(b), append([]string{"--listen", gnetAddr, "--upstream", up},
		strings.Fields(os.Getenv("KVMESH_BENCH_GNET_ARGS"))...)...)
	waitListening(b, routerAddr)
	waitListening(b, bareAddr)
	waitListening(b, gnetAddr)
	round := 2 * time.Second
	if v, err := time.ParseDuration(os.Getenv("KVMESH_BENCH_ROUND")); err == nil {
		round = v
	}
	conns := 64
	if v := os.Getenv("KVMESH_BENCH_CONNS"); v != "" {
		_, _ = fmt.Sscan(v, &conns)
	}
	// Warm all four (connection pools, page cache).
	for _, addr := range []string{routerAddr, bareAddr, gnetAddr, nginx} {
		load(addr, conns, 300*time.Millisecond)
	}
	if path := os.Getenv("KVMESH_BENCH_PPROF"); path != "" {
		// A CPU profile of the router under the same load, for digging.
		done := make(chan struct{})
		go func() { defer close(done); load(routerAddr, conns, 2500*time.Millisecond) }()
		status, body, err := fasthttp.GetTimeout(nil, "http://"+pprofAddr+"/debug/pprof/profile?seconds=2", 10*time.Second)
		<-done
		if err != nil || status != 200 {
			b.Fatalf("profile: %v %d", err, status)
		}
		if err := os.WriteFile(path, body, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	var rt, bare, gn, ng loadResult
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, target := range []struct {
			addr string
			pg   int
			acc  *loadResult
		}{{routerAddr, routerCmd.Process.Pid, &rt}, {bareAddr, bareCmd.Process.Pid, &bare}, {gnetAddr, gnetCmd.Process.Pid, &gn}, {nginx, nginxPG, &ng}} {
			cpu0 := groupCPU(target.pg)
			self0 := selfCPU()
			r := load(target.addr, conns, round)
			target.acc.cpu += groupCPU(target.pg) - cpu0
			target.acc.self += selfCPU() - self0
			target.acc.requests += r.requests
			target.acc.failed += r.failed
			target.acc.elapsed += r.elapsed
			target.acc.lat = append(target.acc.lat, r.lat...)
		}
	}
	b.StopTimer()
	rps := func(r loadResult) float64 { return float64(r.requests) / r.elapsed.Seconds() }
	b.ReportMetric(rps(rt), "router-req/s")
	b.ReportMetric(rps(bare), "bare-req/s")
	b.ReportMetric(rps(gn), "gnet-req/s")
	b.ReportMetric(rps(ng), "nginx-req/s")
	b.ReportMetric(rps(rt)/rps(ng), "ratio")
	b.ReportMetric(rps(bare)/rps(ng), "bare-ratio")
	b.ReportMetric(rps(gn)/rps(ng), "gnet-ratio")
	// CPU per request is what a proxy costs, whatever share of the
	// machine other tenants leave it; req/s on a shared machine is not.
	cpuPer := func(r loadResult) float64 { return float64(r.cpu.Microseconds()) / float64(max(r.requests, 1)) }
	b.ReportMetric(cpuPer(rt), "router-cpu-µs/req")
	b.ReportMetric(cpuPer(bare), "bare-cpu-µs/req")
	b.ReportMetric(cpuPer(gn), "gnet-cpu-µs/req")
	b.ReportMetric(cpuPer(ng), "nginx-cpu-µs/req")
	selfPer := func(r loadResult) float64 { return float64(r.self.Microseconds()) / float64(max(r.requests, 1)) }
	b.ReportMetric(selfPer(rt), "router-rest-µs/req")
	b.ReportMetric(selfPer(bare), "bare-rest-µs/req")
	b.ReportMetric(selfPer(gn), "gnet-rest-µs/req")
	b.ReportMetric(selfPer(ng), "nginx-rest-µs/req")
	b.ReportMetric(float64(quantile(rt.lat, 0.5).Microseconds()), "router-p50-µs")
	b.ReportMetric(float64(quantile(ng.lat, 0.5).Microseconds()), "nginx-p50-µs")
	b.ReportMetric(float64(quantile(rt.lat, 0.99).Microseconds()), "router-p99-µs")
	b.ReportMetric(float64(quantile(ng.lat, 0.99).Microseconds()), "nginx-p99-µs")
	if rt.failed+bare.failed+gn.failed+ng.failed > 0 {
		b.Errorf("failed requests: router %d, bare %d, gnet %d, nginx %d", rt.failed, bare.failed, gn.failed, ng.failed)
	}
}
