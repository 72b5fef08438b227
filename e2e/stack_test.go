// Package e2e runs kvmesh's docker-compose demo cluster (docker-compose.yml at
// the repository root) and puts it through what production does to it:
// replicas killed under load, a router cut off the gossip network, engines
// restarted, a router started late.
//
// Every test brings up its own compose project (unique name, its own gossip
// subnet, ephemeral loopback ports) and tears it down when it ends, pass or
// fail. The tests run only with KVMESH_E2E=1 (`make e2e`, part of `make
// test`) and skip with a message when no Docker engine answers. Traffic goes
// only to the containers' published loopback ports.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// image is the tag the tests build from freshly compiled binaries.
const image = "kvmesh:e2e"

var (
	skipReason string   // non-empty: every test skips with it
	compose    []string // "docker compose" or "docker-compose"
	repoRoot   string
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	root, err := filepath.Abs("..")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	repoRoot = root
	switch {
	case os.Getenv("KVMESH_E2E") != "1":
		skipReason = "docker end-to-end tests need KVMESH_E2E=1 (run `make e2e`; `make test` does)"
	case !dockerAnswers():
		skipReason = "no Docker engine answers (`docker info` failed): docker end-to-end tests skipped"
	default:
		compose = detectCompose()
		if compose == nil {
			skipReason = "neither `docker compose` nor `docker-compose` answers: docker end-to-end tests skipped"
		}
	}
	if skipReason != "" {
		fmt.Println("e2e:", skipReason)
		return m.Run()
	}
	if err := buildImage(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: building the image:", err)
		return 1
	}
	return m.Run()
}

func dockerAnswers() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	return exec.CommandContext(ctx, "docker", "info").Run() == nil
}

// detectCompose prefers the docker CLI plugin, then the standalone v1 tool.
func detectCompose() []string {
	for _, c := range [][]string{{"docker", "compose"}, {"docker-compose"}} {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		err := exec.CommandContext(ctx, c[0], append(c[1:], "version")...).Run()
		cancel()
		if err == nil {
			return c
		}
	}
	return nil
}

// buildImage compiles the static binaries into a scratch directory and builds
// the FROM-scratch image from it, as `make images` does from bin/.
func buildImage() error {
	dir, err := os.MkdirTemp("", "kvmesh-e2e-bin")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", dir+"/",
		"./cmd/router", "./cmd/sidecar", "./cmd/enginesim", "./cmd/healthcheck")
	build.Dir = repoRoot
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %v\n%s", err, out)
	}
	img := exec.CommandContext(ctx, "docker", "build", "-q", "-t", image,
		"-f", filepath.Join(repoRoot, "deploy/docker/Dockerfile"), dir)
	if out, err := img.CombinedOutput(); err != nil {
		return fmt.Errorf("docker build: %v\n%s", err, out)
	}
	return nil
}

// stack is one running compose project.
type stack struct {
	t       *testing.T
	project string
	prefix  string // first three octets of the mesh /24
	env     []string
	routers map[string]string // service → base URL on loopback
	ports   map[string]string // "service port" → published host:port
}

const replicas = 4

// with returns the stack bound to a (sub)test: helpers fail that test.
func (s *stack) with(t *testing.T) *stack {
	c := *s
	c.t = t
	return &c
}

// up starts the compose project with the given services (all when none) and
// waits until every started router is ready. The project is torn down when
// the test ends; on failure its logs are printed first.
func up(t *testing.T, services ...string) *stack {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
	n := rand.IntN(200) + 20
	s := &stack{
		t:       t,
		project: fmt.Sprintf("kvmeshe2e%d%d", os.Getpid()%10000, n),
		prefix:  fmt.Sprintf("10.214.%d", n),
		routers: map[string]string{},
		ports:   map[string]string{},
	}
	s.env = append(os.Environ(),
		"KVMESH_IMAGE="+image,
		"KVMESH_MESH_PREFIX="+s.prefix,
		"KVMESH_ROUTER1_PUBLISH=127.0.0.1:",
		"KVMESH_ROUTER2_PUBLISH=127.0.0.1:",
		// Ten times faster than real time: prefill and decode timing keep
		// their shape, the tests their time budget.
		"KVMESH_TIME_SCALE=0.1",
		"KVMESH_TOKENIZER_SPEC=builtin",
		"KVMESH_LOG_LEVEL=info",
		"KVMESH_ENGINE_API_KEY="+engineAPIKey,
	)
	t.Cleanup(s.down)
	start := time.Now()
	s.compose(3*time.Minute, append([]string{"up", "-d", "--no-build"}, services...)...)
	started := services
	if len(started) == 0 {
		started = []string{"router1", "router2"}
	}
	for _, svc := range started {
		if strings.HasPrefix(svc, "router") {
			s.waitRouter(svc)
		}
	}
	t.Logf("stack %s up in %v", s.project, time.Since(start).Round(time.Millisecond))
	return s
}

// startRouter brings up a router service of a running stack.
func (s *stack) startRouter(svc string) {
	s.t.Helper()
	s.compose(time.Minute, "up", "-d", "--no-build", "--no-deps", svc)
	s.waitRouter(svc)
}

// removeRouter stops a router service and deletes its container, so the
// next start is a router that knows nothing.
func (s *stack) removeRouter(svc string) {
	s.t.Helper()
	s.compose(time.Minute, "rm", "-s", "-f", svc)
	delete(s.routers, svc)
}

func (s *stack) waitRouter(svc string) {
	s.t.Helper()
	delete(s.ports, svc+" 8080") // a new container, a new port
	base := "http://" + s.port(svc, "8080")
	s.routers[svc] = base
	deadline := time.Now().Add(60 * time.Second)
	for {
		if code, _, _ := get(base + "/ready"); code == 200 {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s not ready after 60 s", svc)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (s *stack) down() {
	if s.t.Failed() {
		out, _ := s.run(time.Minute, "logs", "--no-color", "--tail=40")
		s.t.Logf("logs of %s:\n%s", s.project, out)
	}
	if out, err := s.run(2*time.Minute, "down", "-v", "--remove-orphans", "--timeout", "2"); err != nil {
		s.t.Errorf("compose down: %v\n%s", err, out)
	}
}

func (s *stack) run(timeout time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	full := append(append(compose[1:len(compose):len(compose)], "-p", s.project, "-f", filepath.Join(repoRoot, "docker-compose.yml")), args...)
	cmd := exec.CommandContext(ctx, compose[0], full...)
	cmd.Dir = repoRoot
	cmd.Env = s.env
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	return out.String(), err
}

func (s *stack) compose(timeout time.Duration, args ...string) string {
	s.t.Helper()
	out, err := s.run(timeout, args...)
	if err != nil {
		s.t.Fatalf("compose %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// container returns the id of a service's container.
func (s *stack) container(svc string) string {
	s.t.Helper()
	id := strings.TrimSpace(s.compose(30*time.Second, "ps", "-q", svc))
	if id == "" {
		s.t.Fatalf("no container for %s", svc)
	}
	return id
}

// An engineProcess is a container and the host's pid of its entrypoint.
type engineProcess struct {
	container string
	pid       int
}

func (s *stack) engineProcess(svc string) engineProcess {
	s.t.Helper()
	p := engineProcess{container: s.container(svc)}
	out, err := exec.Command("docker", "inspect", "-f", "{{.State.Pid}}", p.container).Output()
	if err != nil {
		return p
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	// The pid is the daemon's view; run from inside another container the
	// same number is some other process of ours. Signal it only when its
	// cgroup names the container.
	if cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err == nil && strings.Contains(string(cg), p.container) {
		p.pid = pid
	}
	return p
}

// kill ends an engine as `docker kill` does (SIGKILL to the container's
// first process) but at once: the docker CLI and daemon can take seconds on
// a loaded host, long enough for a stream meant to be cut to finish. Where
// the test cannot see or signal the process, it falls back to `docker kill`.
func (s *stack) kill(p engineProcess) {
	s.t.Helper()
	if p.pid > 0 && syscall.Kill(p.pid, syscall.SIGKILL) == nil {
		return
	}
	s.docker("kill", p.container)
}

func (s *stack) docker(args ...string) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "docker", args...).CombinedOutput(); err != nil {
		s.t.Fatalf("docker %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// port returns the loopback host:port a service's container port is
// published on. One `docker ps` reads them all (compose v1 takes seconds per
// `port` call on a loaded machine); a miss re-reads once.
func (s *stack) port(svc, port string) string {
	s.t.Helper()
	key := svc + " " + port
	if a, ok := s.ports[key]; ok {
		return a
	}
	s.readPorts()
	a, ok := s.ports[key]
	if !ok {
		s.t.Fatalf("%s: port %s not published", svc, port)
	}
	return a
}

func (s *stack) readPorts() {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "docker", "ps", "--filter", "label=com.docker.compose.project="+s.project,
		"--format", `{{.Label "com.docker.compose.service"}}|{{.Ports}}`).CombinedOutput()
	if err != nil {
		s.t.Fatalf("docker ps: %v\n%s", err, out)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		svc, ports, _ := strings.Cut(line, "|")
		// 127.0.0.1:49153->8000/tcp, 127.0.0.1:49154->9100/tcp
		for _, p := range strings.Split(ports, ", ") {
			host, ctr, ok := strings.Cut(p, "->")
			if !ok {
				continue
			}
			s.ports[svc+" "+strings.TrimSuffix(ctr, "/tcp")] = host
		}
	}
}

// sidecarStatus reads replicaN's sidecar /status through its published port.
func (s *stack) sidecarStatus(replica string) sidecarStatus {
	s.t.Helper()
	var st sidecarStatus
	code, body, err := get("http://" + s.port(replica, "9100") + "/status")
	if err != nil || code != 200 {
		s.t.Fatalf("%s /status: %d %v %s", replica, code, err, body)
	}
	if err := json.Unmarshal(body, &st); err != nil {
		s.t.Fatalf("%s /status: %v", replica, err)
	}
	return st
}

type sidecarStatus struct {
	Name             string `json:"name"`
	BlockSize        int    `json:"block_size"`
	EngineHealthy    bool   `json:"engine_healthy"`
	ResidentBlocks   int    `json:"resident_blocks"`
	FilterGeneration uint64 `json:"filter_generation"`
	FilterKeys       int    `json:"filter_keys"`
	EventsReceived   uint64 `json:"events_received"`
	EngineResets     uint64 `json:"engine_resets"`
	Connected        bool   `json:"events_connected"`
	Routers          int    `json:"routers"`
}

// replicaView is one entry of a router's /admin/replicas.
type replicaView struct {
	Name             string `json:"name"`
	Online           bool   `json:"online"`
	Stale            bool   `json:"stale"`
	KVEvents         bool   `json:"kv_events"`
	BlockSize        int    `json:"block_size"`
	FilterGeneration uint64 `json:"filter_generation"`
	FilterKeys       int    `json:"filter_keys"`
	StateAgeMS       int64  `json:"state_age_ms"`
	Waiting          int    `json:"waiting"`
	Running          int    `json:"running"`
	ClusterInflight  int    `json:"cluster_inflight_requests"`
}

func (s *stack) replicas(router string) map[string]replicaView {
	s.t.Helper()
	code, body, err := get(s.routers[router] + "/admin/replicas")
	if err != nil || code != 200 {
		s.t.Fatalf("%s /admin/replicas: %d %v %s", router, code, err, body)
	}
	var list []replicaView
	if err := json.Unmarshal(body, &list); err != nil {
		s.t.Fatalf("%s /admin/replicas: %v", router, err)
	}
	out := make(map[string]replicaView, len(list))
	for _, r := range list {
		out[r.Name] = r
	}
	return out
}

// resumedStreams reads, from both routers' /metrics, how many streams
// another replica took over ("router1=N router2=M").
func (s *stack) resumedStreams() string {
	var out []string
	for _, rt := range []string{"router1", "router2"} {
		n := "0"
		if _, body, err := get(s.routers[rt] + "/metrics"); err == nil {
			for _, line := range strings.Split(string(body), "\n") {
				if v, ok := strings.CutPrefix(line, `kvmesh_router_errors_total{type="stream_resumed"} `); ok {
					n = v
				}
			}
		}
		out = append(out, rt+"="+n)
	}
	return strings.Join(out, " ")
}

// eventually polls cond every 50 ms until it holds or the budget is spent;
// it returns how long that took and whether it held.
func eventually(budget time.Duration, cond func() bool) (time.Duration, bool) {
	start := time.Now()
	for {
		if cond() {
			return time.Since(start), true
		}
		if time.Since(start) > budget {
			return time.Since(start), false
		}
		time.Sleep(50 * time.Millisecond)
	}
}

var client = &http.Client{Timeout: 30 * time.Second}

func get(url string) (int, []byte, error) {
	resp, err := client.Get(url)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, b, err
}

// chatResult is what a test needs from one chat completion.
type chatResult struct {
	Status          int
	Replica         string
	Mode            string
	PredictedCached int // X-Kvmesh-Cached-Tokens
	PromptTokens    int
	EngineCached    int // usage.prompt_tokens_details.cached_tokens
	Content         string
	Body            string
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// engineAPIKey is what the stack's engines are started with (--api-key):
// sidecars and routers send it; a test talking to an engine directly must.
const engineAPIKey = "e2e-engine-key"

func chat(base string, msgs []message, maxTokens int) (chatResult, error) {
	return chatWithKey(base, "", msgs, maxTokens)
}

// chatWithKey is chat with apiKey as a bearer token (none when empty).
func chatWithKey(base, apiKey string, msgs []message, maxTokens int) (chatResult, error) {
	body, _ := json.Marshal(map[string]any{"model": "enginesim", "messages": msgs, "max_tokens": maxTokens})
	req, err := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return chatResult{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		return chatResult{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return chatResult{}, err
	}
	r := chatResult{Status: resp.StatusCode, Body: string(raw),
		Replica: resp.Header.Get("X-Kvmesh-Replica"), Mode: resp.Header.Get("X-Kvmesh-Mode")}
	fmt.Sscan(resp.Header.Get("X-Kvmesh-Cached-Tokens"), &r.PredictedCached)
	if resp.StatusCode != 200 {
		return r, nil
	}
	var doc struct {
		Choices []struct {
			Message message `json:"message"`
		} `json:"choices"`
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		return r, fmt.Errorf("chat response: %v: %s", err, raw)
	}
	r.PromptTokens, r.EngineCached = doc.Usage.PromptTokens, doc.Usage.Details.CachedTokens
	if len(doc.Choices) > 0 {
		r.Content = doc.Choices[0].Message.Content
	}
	return r, nil
}

// streamChat sends a streamed chat and reads it to the end. It returns the
// answer's text chunks and the replica that started it, or an error for a
// status other than 200, an error event, or a stream without its [DONE].
func streamChat(base string, msgs []message, maxTokens int) (chunks int, replica string, err error) {
	replica, body, err := startStream(base, msgs, maxTokens)
	if err != nil {
		return 0, "", err
	}
	defer body.Close()
	chunks, err = readStream(body)
	return chunks, replica, err
}

// startStream sends a streamed chat and returns once its headers arrived:
// the replica serving it and the stream, to be read and closed.
func startStream(base string, msgs []message, maxTokens int) (replica string, body io.ReadCloser, err error) {
	req, _ := json.Marshal(map[string]any{"model": "enginesim", "messages": msgs, "max_tokens": maxTokens, "stream": true})
	resp, err := client.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(req))
	if err != nil {
		return "", nil, err
	}
	if resp.StatusCode != 200 {
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		return "", nil, fmt.Errorf("status %d: %s", resp.StatusCode, raw)
	}
	return resp.Header.Get("X-Kvmesh-Replica"), resp.Body, nil
}

// readStream counts an answer's text chunks; an error event or a missing
// [DONE] is an error.
func readStream(body io.Reader) (int, error) {
	raw, err := io.ReadAll(io.LimitReader(body, 4<<20))
	if err != nil {
		return 0, err
	}
	chunks, done := 0, false
	for _, ev := range strings.Split(string(raw), "\n\n") {
		data, ok := strings.CutPrefix(strings.TrimSpace(ev), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			continue
		}
		var c struct {
			Error   json.RawMessage `json:"error"`
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil || c.Error != nil {
			return chunks, fmt.Errorf("event %q (%v)", data, err)
		}
		if len(c.Choices) > 0 && c.Choices[0].Delta.Content != "" {
			chunks++
		}
	}
	if !done {
		return chunks, fmt.Errorf("no [DONE] after %d chunks", chunks)
	}
	return chunks, nil
}

// conversation returns a system prompt long enough for many full blocks,
// distinct per seed, and one user turn.
func conversation(seed string) []message {
	var b strings.Builder
	fmt.Fprintf(&b, "You are assistant %s of the kvmesh end-to-end suite. ", seed)
	for i := 0; i < 12; i++ {
		fmt.Fprintf(&b, "Rule %d for %s: answer briefly, cite the routing table, keep prefixes warm. ", i, seed)
	}
	return []message{{Role: "system", Content: b.String()}, {Role: "user", Content: "What is cached for " + seed + "?"}}
}

// followUp extends a conversation by the answer and a new user turn, so its
// prompt starts with the whole earlier prompt.
func followUp(msgs []message, answer, question string) []message {
	out := append([]message(nil), msgs...)
	return append(out, message{Role: "assistant", Content: answer}, message{Role: "user", Content: question})
}
