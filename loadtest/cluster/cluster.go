// Package cluster starts a whole kvmesh fleet as real processes on
// loopback — an enginesim and its sidecar per replica (a sidecar per rank
// of a data-parallel enginesim), and routers — waits
// until every router sees every replica, and tears it all down again, also
// on failure or Ctrl-C, leaving no process behind.
package cluster

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Config describes one fleet.
type Config struct {
	BinDir   string // holds enginesim, sidecar, router
	OutDir   string // one log file per process
	Replicas int    // engine servers
	// DataParallelSize above 1 runs each server with that many
	// data-parallel ranks (enginesim --data-parallel-size), their KV
	// events on ports shifted by rank as vLLM's, and one sidecar per rank
	// (--data-parallel-rank): Replicas × DataParallelSize replicas.
	DataParallelSize int
	Routers          int
	Policy           string
	Model            string // served model name; default "sim"
	KVBlocks         int    // per replica (per rank); 0 leaves enginesim's default
	BlockSize        int    // 0 leaves enginesim's default
	TimeScale        float64
	GossipKey        string // base64; a fresh random key when empty
	// Extra flags appended per binary (e.g. a cost profile).
	EngineArgs, SidecarArgs, RouterArgs []string
	// KVRoles names, by server, the side of prefill/decode disaggregation
	// its engine and sidecars play (--kv-role); a server past its end, or
	// named "", plays both.
	KVRoles []string
	// PrefillEngineArgs are appended to EngineArgs for the servers whose
	// role is prefill: a prefill pool tuned apart from the decode pool.
	PrefillEngineArgs []string
	ReadyTimeout      time.Duration // default 60 s
	Grace             time.Duration // SIGTERM → SIGKILL; default 5 s
}

// Cluster is a running fleet.
type Cluster struct {
	Routers  []string // router base URLs
	Engines  []string // engine server base URLs, server i at index i
	Sidecars []string // sidecar status base URLs, one per replica
	Names    []string // replica names as gossiped, in Sidecars' order
	// RunID marks every process of this cluster: its environment holds
	// RunEnv=RunID, so leftovers can be found even after a crash.
	RunID   string
	cfg     Config
	env     []string
	mu      sync.Mutex
	procs   []*Proc
	stopped bool
}

// Start launches the fleet and returns once every router lists every
// replica online, or stops whatever it started and returns the error.
func Start(ctx context.Context, cfg Config) (_ *Cluster, err error) {
	if cfg.Replicas <= 0 || cfg.Routers <= 0 {
		return nil, fmt.Errorf("cluster: need at least one replica and one router, got %d and %d", cfg.Replicas, cfg.Routers)
	}
	if cfg.Model == "" {
		cfg.Model = "sim"
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = 60 * time.Second
	}
	if cfg.Grace <= 0 {
		cfg.Grace = 5 * time.Second
	}
	if cfg.GossipKey == "" {
		key := make([]byte, 32)
		if _, err := rand.Read(key); err != nil {
			return nil, err
		}
		cfg.GossipKey = base64.StdEncoding.EncodeToString(key)
	}
	for _, b := range []string{"enginesim", "sidecar", "router"} {
		if _, err := os.Stat(filepath.Join(cfg.BinDir, b)); err != nil {
			return nil, fmt.Errorf("cluster: %w (run make build)", err)
		}
	}
	id := make([]byte, 8)
	if _, err := rand.Read(id); err != nil {
		return nil, err
	}
	c := &Cluster{cfg: cfg, RunID: fmt.Sprintf("%x", id)}
	c.env = childEnv(os.Environ(), c.RunID)
	defer func() {
		if err != nil {
			c.Stop()
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, cfg.ReadyTimeout)
	defer cancel()

	ranks := max(cfg.DataParallelSize, 1)
	ports := &portPicker{}
	engineEvents := make([]int, cfg.Replicas)
	engineReplay := make([]int, cfg.Replicas)
	for i := range cfg.Replicas {
		port, err := ports.tcp()
		if err != nil {
			return nil, err
		}
		// Rank r publishes on the given ports plus r.
		if engineEvents[i], err = ports.run(ranks); err != nil {
			return nil, err
		}
		if engineReplay[i], err = ports.run(ranks); err != nil {
			return nil, err
		}
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		args := []string{
			"--listen", fmt.Sprintf("127.0.0.1:%d", port),
			"--model", cfg.Model, "--tokenizer", "builtin",
			// vLLM's rule: a wildcard host binds; the sidecar connects.
			"--kv-events", fmt.Sprintf("tcp://*:%d", engineEvents[i]),
			"--kv-replay", fmt.Sprintf("tcp://*:%d", engineReplay[i]),
			"--time-scale", strconv.FormatFloat(cfg.TimeScale, 'g', -1, 64),
			"--log-format", "json",
		}
		if cfg.KVBlocks > 0 {
			args = append(args, "--kv-blocks", strconv.Itoa(cfg.KVBlocks))
		}
		if cfg.BlockSize > 0 {
			args = append(args, "--block-size", strconv.Itoa(cfg.BlockSize))
		}
		if ranks > 1 {
			args = append(args, "--data-parallel-size", strconv.Itoa(ranks))
		}
		args = append(args, cfg.EngineArgs...)
		if role := cfg.role(i); role != "" {
			args = append(args, "--kv-role", role)
			if role == "prefill" {
				args = append(args, cfg.PrefillEngineArgs...)
			}
		}
		if err := c.start(fmt.Sprintf("enginesim-%d", i), "enginesim", args); err != nil {
			return nil, err
		}
		c.Engines = append(c.Engines, url)
	}
	for _, u := range c.Engines {
		if err := c.waitHTTP(ctx, u+"/health", nil); err != nil {
			return nil, err
		}
	}

	// Router 0 is the gossip seed: it must listen before anyone joins it.
	var seed string
	var gossipAddrs []string
	for i := range cfg.Routers {
		port, err := ports.tcp()
		if err != nil {
			return nil, err
		}
		gport, err := ports.gossip()
		if err != nil {
			return nil, err
		}
		gaddr := fmt.Sprintf("127.0.0.1:%d", gport)
		args := []string{
			"--listen", fmt.Sprintf("127.0.0.1:%d", port),
			"--gossip-bind", gaddr, "--gossip-advertise", gaddr, "--gossip-key", cfg.GossipKey,
			"--policy", cfg.Policy, "--tokenizer", cfg.Model + "=builtin",
			"--log-format", "json",
		}
		if seed != "" {
			args = append(args, "--join", seed)
		}
		if err := c.start(fmt.Sprintf("router-%d", i), "router", append(args, cfg.RouterArgs...)); err != nil {
			return nil, err
		}
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		c.Routers = append(c.Routers, url)
		gossipAddrs = append(gossipAddrs, gaddr)
		if seed == "" {
			seed = gaddr
			if err := c.waitHTTP(ctx, url+"/health", nil); err != nil {
				return nil, err
			}
		}
	}
	for _, u := range c.Routers[1:] {
		if err := c.waitHTTP(ctx, u+"/health", nil); err != nil {
			return nil, err
		}
	}

	for n := range cfg.Replicas * ranks {
		i, rank := n/ranks, n%ranks
		port, err := ports.tcp()
		if err != nil {
			return nil, err
		}
		gport, err := ports.gossip()
		if err != nil {
			return nil, err
		}
		name, proc := fmt.Sprintf("replica-%d", i), "sidecar-"+strconv.Itoa(i)
		if ranks > 1 {
			name, proc = fmt.Sprintf("replica-%d-rank-%d", i, rank), fmt.Sprintf("sidecar-%d-rank-%d", i, rank)
		}
		gaddr := fmt.Sprintf("127.0.0.1:%d", gport)
		args := []string{
			"--engine", c.Engines[i],
			"--kv-events", fmt.Sprintf("tcp://127.0.0.1:%d", engineEvents[i]+rank),
			"--kv-replay", fmt.Sprintf("tcp://127.0.0.1:%d", engineReplay[i]+rank),
			"--name", name,
			"--gossip-bind", gaddr, "--gossip-advertise", gaddr, "--gossip-key", cfg.GossipKey,
			"--join", strings.Join(gossipAddrs, ","),
			"--listen", fmt.Sprintf("127.0.0.1:%d", port),
			"--log-format", "json",
		}
		if ranks > 1 {
			args = append(args, "--data-parallel-rank", strconv.Itoa(rank))
		}
		if role := cfg.role(i); role != "" {
			args = append(args, "--kv-role", role)
		}
		if err := c.start(proc, "sidecar", append(args, cfg.SidecarArgs...)); err != nil {
			return nil, err
		}
		c.Sidecars = append(c.Sidecars, fmt.Sprintf("http://127.0.0.1:%d", port))
		c.Names = append(c.Names, name)
	}
	for _, u := range c.Sidecars {
		if err := c.waitHTTP(ctx, u+"/health", nil); err != nil {
			return nil, err
		}
	}
	for _, u := range c.Routers {
		if err := c.waitHTTP(ctx, u+"/ready", nil); err != nil {
			return nil, err
		}
		if err := c.waitHTTP(ctx, u+"/admin/replicas", c.allOnline); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *Cluster) start(name, bin string, args []string) error {
	p, err := StartProc(name, filepath.Join(c.cfg.BinDir, bin), args, c.env, filepath.Join(c.cfg.OutDir, name+".log"))
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		p.Stop(c.cfg.Grace)
		return errors.New("cluster: stopped while starting")
	}
	c.procs = append(c.procs, p)
	return nil
}

// Replica is the part of a router's /admin/replicas entry readiness needs.
type Replica struct {
	Name             string  `json:"name"`
	Online           bool    `json:"online"`
	Waiting          float64 `json:"waiting"`
	Running          float64 `json:"running"`
	KVUsage          float64 `json:"kv_usage"`
	FilterGeneration uint64  `json:"filter_generation"`
	FilterKeys       uint64  `json:"filter_keys"`
	StateAgeMs       float64 `json:"state_age_ms"`
}

// allOnline accepts an /admin/replicas body listing every replica online.
func (c *Cluster) allOnline(body []byte) error {
	var reps []Replica
	if err := json.Unmarshal(body, &reps); err != nil {
		return fmt.Errorf("admin/replicas: %w", err)
	}
	online := map[string]bool{}
	for _, r := range reps {
		if r.Online {
			online[r.Name] = true
		}
	}
	var missing []string
	for _, n := range c.Names {
		if !online[n] {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("replicas not online yet: %s", strings.Join(missing, ","))
	}
	return nil
}

// waitHTTP polls url until it answers 200 (and check accepts the body),
// failing fast when a process of the cluster has exited.
func (c *Cluster) waitHTTP(ctx context.Context, url string, check func([]byte) error) error {
	client := &http.Client{Timeout: 2 * time.Second}
	var last error
	for {
		if err := c.exitedEarly(); err != nil {
			return err
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := client.Do(req)
		if err == nil {
			body, rerr := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
			resp.Body.Close()
			switch {
			case rerr != nil:
				err = rerr
			case resp.StatusCode != http.StatusOK:
				err = fmt.Errorf("status %d", resp.StatusCode)
			case check != nil:
				err = check(body)
			}
			if err == nil {
				return nil
			}
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster: waiting for %s: %v (last: %v)", url, ctx.Err(), last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *Cluster) exitedEarly() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.procs {
		if done, err := p.Exited(); done && !p.dead.Load() {
			return fmt.Errorf("cluster: %s exited during start-up (%v); log %s ends:\n%s", p.Name, err, p.LogPath, p.TailLog(2000))
		}
	}
	return nil
}

// Exited returns an error naming any process that is no longer running,
// but for those KillEngine killed.
func (c *Cluster) Exited() error { return c.exitedEarly() }

// KillEngine kills engine server i with SIGKILL, its sidecars left
// running as a real node's would be when its engine crashed. It returns
// the process's name.
func (c *Cluster) KillEngine(i int) (string, error) {
	name := fmt.Sprintf("enginesim-%d", i)
	c.mu.Lock()
	var p *Proc
	for _, q := range c.procs {
		if q.Name == name {
			p = q
		}
	}
	c.mu.Unlock()
	if p == nil {
		return name, fmt.Errorf("cluster: no engine server %d", i)
	}
	p.Kill()
	return name, nil
}

// RouterCPU returns the CPU time the routers have used so far, summed:
// what sizes a router fleet (CPU per request routed).
func (c *Cluster) RouterCPU() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	var total time.Duration
	for _, p := range c.procs {
		if strings.HasPrefix(p.Name, "router-") {
			if d, ok := p.CPU(); ok {
				total += d
			}
		}
	}
	return total
}

// Pids lists the process ids (= process group ids) of the fleet.
func (c *Cluster) Pids() []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]int, 0, len(c.procs))
	for _, p := range c.procs {
		out = append(out, p.Pid())
	}
	return out
}

// Stop terminates every process (SIGTERM to each group at once, SIGKILL
// after the grace period) and waits for all of them. It returns the names
// of processes that needed SIGKILL. Safe to call more than once.
func (c *Cluster) Stop() (killed []string) {
	c.mu.Lock()
	c.stopped = true
	procs := c.procs
	c.mu.Unlock()
	var wg sync.WaitGroup
	var mu sync.Mutex
	for _, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if p.Stop(c.cfg.Grace) {
				mu.Lock()
				killed = append(killed, p.Name)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return killed
}

// RunEnv is the environment variable naming a process's cluster.
const RunEnv = "KVMESH_LOADTEST_RUN"

// childEnv drops KVMESH_* variables meant for the load test itself —
// every kvmesh binary reads its flags from them — and adds the run marker.
func childEnv(env []string, runID string) []string {
	out := make([]string, 0, len(env)+1)
	for _, kv := range env {
		if !strings.HasPrefix(kv, "KVMESH_") {
			out = append(out, kv)
		}
	}
	return append(out, RunEnv+"="+runID)
}

// portPicker hands out distinct free loopback ports. Gossip ports must be
// free for both TCP and UDP (memberlist uses both on one port).
type portPicker struct{ used map[int]bool }

func (p *portPicker) tcp() (int, error) { return p.pick(false) }

func (p *portPicker) gossip() (int, error) { return p.pick(true) }

// run returns the first of n consecutive free TCP ports (a data-parallel
// engine's per-rank endpoints). They are drawn below the kernel's
// ephemeral range, where no outgoing connection can take one between this
// check and the engine's bind (on every address, as tcp://*: binds).
func (p *portPicker) run(n int) (int, error) {
	if p.used == nil {
		p.used = map[int]bool{}
	}
	lo, hi := listenRange()
	for range 200 {
		first := lo + mrand.IntN(hi-lo-n)
		ok := true
		for port := first; port < first+n && ok; port++ {
			l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
			if ok = err == nil && !p.used[port]; err == nil {
				l.Close()
			}
		}
		if ok {
			for port := first; port < first+n; port++ {
				p.used[port] = true
			}
			return first, nil
		}
	}
	return 0, fmt.Errorf("cluster: no %d consecutive free ports found", n)
}

func (p *portPicker) pick(udpToo bool) (int, error) {
	if p.used == nil {
		p.used = map[int]bool{}
	}
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		ok := !p.used[port]
		if ok && udpToo {
			u, err := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				ok = false
			} else {
				u.Close()
			}
		}
		l.Close()
		if ok {
			p.used[port] = true
			return port, nil
		}
	}
	return 0, errors.New("cluster: no free port found")
}

// listenRange is the span of ports below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range; Linux's default starts at
// 32768) the per-rank endpoints are drawn from.
func listenRange() (lo, hi int) {
	lo, hi = 20000, 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if start, err := strconv.Atoi(f[0]); err == nil && start > 2048 {
				lo, hi = start/2, start
			}
		}
	}
	return lo, hi
}

// role is server i's --kv-role, "" for both.
func (c Config) role(i int) string {
	if i < len(c.KVRoles) {
		return c.KVRoles[i]
	}
	return ""
}
