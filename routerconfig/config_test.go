package routerconfig

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/enginesim"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gateway"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/tokenize"
)

const sample = `
policy: chwbl
routing:
  prefill_per_token: 40us
  imbalance_enter: 5
max_prefix_tokens: 8192
default_tokenizer: builtin
models:
  - name: llama
    tokenizer: builtin
    fallback:
      - name: cloud
        url: https://api.example.com
        api_key_env: KVMESH_TEST_FALLBACK_KEY
  - name: llama-sql
    adapter_of: llama
selection: [a, b, c]
static_upstreams:
  - {name: s1, url: "http://127.0.0.1:9", models: [llama]}
api_keys: [k1]
upstream:
  first_byte_timeout: 5m
resume_streams: true
`

func TestParseBuildAndOverlay(t *testing.T) {
	t.Setenv("KVMESH_TEST_FALLBACK_KEY", "sk-test")
	c, err := Parse([]byte(sample))
	if err != nil {
		t.Fatal(err)
	}
	if c.Routing.PrefillPerToken != 40*time.Microsecond || c.Upstream.FirstByteTimeout != 5*time.Minute || len(c.Selection) != 3 {
		t.Fatalf("parsed %+v", c)
	}
	base, err := FromFlags(Flags{Policy: "kvaware", Tokenizers: List{"llama=engine", "other=builtin"}, Statics: List{"s0=http://127.0.0.1:8"}, MaxPrefixTokens: 16384})
	if err != nil {
		t.Fatal(err)
	}
	merged := Overlay(base, c)
	if merged.Policy != "chwbl" || merged.MaxPrefixTokens != 8192 || len(merged.Models) != 3 || len(merged.StaticUpstreams) != 2 {
		t.Fatalf("overlay %+v", merged)
	}
	if merged.Models[0].Tokenizer != "builtin" {
		t.Fatalf("file's tokenizer should win: %+v", merged.Models[0])
	}
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{}), AdminToken: "adm"}
	s, err := b.Build(merged)
	if err != nil {
		t.Fatal(err)
	}
	if s.Policy.Name() != "chwbl" || s.AdminToken != "adm" || !s.APIKeys["k1"] || s.DefaultTokenizer == nil || !s.ResumeStreams {
		t.Fatalf("settings %+v", s)
	}
	lora := s.Models["llama-sql"]
	if lora.Adapter != "llama-sql" || lora.Base != "llama" || lora.Tokenizer == nil {
		t.Fatalf("adapter %+v", lora)
	}
	if fb := s.Models["llama"].Fallback; len(fb) != 1 || fb[0].Name != "cloud" {
		t.Fatalf("fallback %+v", fb)
	}
	// Same policy and parameters: the policy (and its state) survives a rebuild.
	s2, _ := b.Build(merged)
	if s2.Policy != s.Policy {
		t.Fatal("policy rebuilt although unchanged")
	}
}

func TestCalibrationSettingFromFlagAndFile(t *testing.T) {
	base, err := FromFlags(Flags{Policy: "kvaware", CalibrateCost: true})
	if err != nil {
		t.Fatal(err)
	}
	calibrates := func(file string) bool {
		t.Helper()
		f, err := Parse([]byte(file))
		if err != nil {
			t.Fatal(err)
		}
		return Overlay(base, f).Routing.Config().Calibrate
	}
	if !calibrates("") || !calibrates("routing: {cold_slack: 20ms}\n") {
		t.Error("a file without routing.calibrate should keep the flag's setting")
	}
	if calibrates("routing: {calibrate: false}\n") {
		t.Error("the file's routing.calibrate should win over the flag")
	}
	// Each reload parses a new *bool: equal values must keep the policy
	// (and the costs it learned).
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{})}
	var policies []any
	for range 2 {
		f, err := Parse([]byte("routing: {calibrate: true, per_running: 2ms}\n"))
		if err != nil {
			t.Fatal(err)
		}
		s, err := b.Build(Overlay(base, f))
		if err != nil {
			t.Fatal(err)
		}
		policies = append(policies, s.Policy)
	}
	if policies[0] != policies[1] {
		t.Error("policy rebuilt on a reload that changed nothing")
	}
}

func TestInvalidConfigsAreRejected(t *testing.T) {
	cases := map[string]string{
		"unknown key":     "polciy: kvaware\n",
		"bad policy":      "policy: fastest\n",
		"selection":       "selection: [only-one]\n",
		"bad duration":    "routing: {cold_slack: soon}\n",
		"fallback url":    "models: [{name: m, fallback: [{url: ftp://x}]}]\n",
		"static twice":    "static_upstreams: [{name: a, url: 'http://x'}, {name: a, url: 'http://y'}]\n",
		"no model name":   "models: [{tokenizer: builtin}]\n",
		"negative spill":  "models: [{name: m, spill_after: -1s, fallback: [{url: 'http://x'}]}]\n",
		"not yaml":        "{{{",
		"negative cost":   "routing: {per_running: -1ms}\n",
		"negative rate":   "routing: {prefill_per_token: -30us}\n",
		"bound below 1":   "routing: {load_bound: 0.5}\n",
		"exit over enter": "routing: {imbalance_enter: 2, imbalance_exit: 3}\n",
		// Table.Select counts distinct names: [a, a] would pass here and
		// fail when applied.
		"selection twice":     "selection: [a, a]\n",
		"static url, no host": "static_upstreams: [{name: s, url: 'http://'}]\n",
		"fallback, no host":   "models: [{name: m, fallback: [{url: 'https://'}]}]\n",
	}
	for name, doc := range cases {
		if _, err := Parse([]byte(doc)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := Parse(nil); err != nil {
		t.Errorf("empty file: %v", err)
	}
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{})}
	if _, err := b.Build(&Config{Models: []Model{{Name: "m", Tokenizer: "/no/such/dir"}}}); err == nil {
		t.Error("missing tokenizer dir accepted")
	}
	// A key pasted where its variable's name belongs: the error (which the
	// reloader logs) must not carry it.
	if _, err := b.Build(&Config{EngineAPIKeyEnv: "sk-live-SECRET123"}); err == nil || strings.Contains(err.Error(), "SECRET123") {
		t.Errorf("engine_api_key_env holding a key: %v", err)
	}
	if _, err := b.Build(&Config{Models: []Model{{Name: "m", Fallback: []Endpoint{{URL: "http://x", APIKeyEnv: "KVMESH_TEST_UNSET_VAR"}}}}}); err == nil {
		t.Error("fallback with an empty key variable accepted")
	}
	if _, err := b.Build(&Config{Models: []Model{{Name: "m", SpillAfter: 5 * time.Second}}}); err == nil {
		t.Error("spill_after without a fallback accepted")
	}
}

func startEngine(t *testing.T) string {
	sim, err := enginesim.New(enginesim.Config{
		Model: "sim", Tokenizer: tokenize.Builtin{},
		Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192, MaxModelLen: 32768},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go sim.Run(ctx)
	return serve(t, &fasthttp.Server{Handler: sim.Handler, CloseOnShutdown: true})
}

func serve(t *testing.T, srv *fasthttp.Server) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.ShutdownWithContext(ctx)
	})
	return "http://" + ln.Addr().String()
}

// TestReloadUnderLoadDropsNothing rewrites the config file (policy, static
// upstream set, an invalid version in between) while clients keep sending.
func TestReloadUnderLoadDropsNothing(t *testing.T) {
	engines := []string{startEngine(t), startEngine(t), startEngine(t)}
	dir := t.TempDir()
	path := filepath.Join(dir, "router.yaml")
	write := func(i int) {
		doc := fmt.Sprintf("policy: %s\ndefault_tokenizer: builtin\nstatic_upstreams:\n  - {name: s%d, url: %q, models: [sim]}\n  - {name: s%d, url: %q, models: [sim]}\n",
			[]string{"kvaware", "round-robin", "least-loaded"}[i%3], i%3, engines[i%3], (i+1)%3, engines[(i+1)%3])
		if i%5 == 4 {
			doc = "policy: nonsense\n" // invalid: logged, old config kept
		}
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil { // atomic replace, as ConfigMaps do
			t.Fatal(err)
		}
	}
	write(0)
	table := fleet.NewTable(fleet.TableConfig{})
	b := &Builder{Table: table}
	base := &Config{}
	var reloads atomic.Int64
	r := &Reloader{Base: base, Path: path, Builder: b, Log: zerolog.Nop(), Settle: 10 * time.Millisecond}
	cfg, err := Load(path, DefaultMaxBytes, 0)
	if err != nil {
		t.Fatal(err)
	}
	s, err := b.Build(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.Gateway = gateway.New(table, nil, s, zerolog.Nop())
	if err := b.Apply(r.Gateway, cfg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := r.Watch(ctx, func() { reloads.Add(1) }); err != nil {
		t.Fatal(err)
	}
	url := serve(t, r.Gateway.Server(1<<20))

	var failed, ok atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	client := &fasthttp.Client{}
	for w := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				req := fasthttp.AcquireRequest()
				resp := fasthttp.AcquireResponse()
				req.SetRequestURI(url + "/v1/completions")
				req.Header.SetMethod("POST")
				req.SetBodyString(fmt.Sprintf(`{"model":"sim","prompt":"worker %d request %d","max_tokens":2}`, w, i))
				if err := client.DoTimeout(req, resp, 5*time.Second); err != nil || resp.StatusCode() != 200 {
					failed.Add(1)
					t.Logf("failed: %v %d %s", err, resp.StatusCode(), resp.Body())
				} else {
					ok.Add(1)
				}
				fasthttp.ReleaseRequest(req)
				fasthttp.ReleaseResponse(resp)
			}
		}()
	}
	for i := 1; i <= 30; i++ {
		write(i)
		time.Sleep(40 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	if failed.Load() != 0 || ok.Load() < 100 || reloads.Load() < 5 {
		t.Fatalf("%d failed, %d ok, %d reloads", failed.Load(), ok.Load(), reloads.Load())
	}
	t.Logf("%d requests, 0 failed, across %d reloads", ok.Load(), reloads.Load())
}

func TestExampleConfigIsValid(t *testing.T) {
	t.Setenv("BACKUP_API_KEY", "k")
	c, err := Load("example.yaml", DefaultMaxBytes, 0)
	if err != nil {
		t.Fatal(err)
	}
	if c.Routing.PrefillPerToken != 30*time.Microsecond || len(c.Models) != 2 || c.Upstream.FirstByteTimeout != 10*time.Minute {
		t.Fatalf("%+v", c)
	}
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{})}
	c.Models[0].Tokenizer = "builtin" // the example's directory is not on this machine
	if _, err := b.Build(c); err != nil {
		t.Fatal(err)
	}
}

// TestEngineAPIKey: the engines' key comes from the flag, or from the
// environment variable the file names (which wins); a named variable that
// is empty is an error, not a silent "no key".
func TestEngineAPIKey(t *testing.T) {
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{}), EngineAPIKey: "from-flag"}
	s, err := b.Build(&Config{})
	if err != nil || s.EngineAPIKey != "from-flag" {
		t.Fatalf("flag only: %q %v", s.EngineAPIKey, err)
	}
	t.Setenv("KVMESH_TEST_ENGINE_KEY", "from-env")
	c, err := Parse([]byte("engine_api_key_env: KVMESH_TEST_ENGINE_KEY\n"))
	if err != nil {
		t.Fatal(err)
	}
	if s, err = b.Build(Overlay(&Config{}, c)); err != nil || s.EngineAPIKey != "from-env" {
		t.Fatalf("file's variable: %q %v", s.EngineAPIKey, err)
	}
	t.Setenv("KVMESH_TEST_ENGINE_KEY", "")
	if _, err := b.Build(c); err == nil || !strings.Contains(err.Error(), "KVMESH_TEST_ENGINE_KEY") {
		t.Fatalf("empty variable: %v", err)
	}
}

// TestSpillAfter: spill_after reaches the gateway's model settings from the
// file and from --spill-after.
func TestSpillAfter(t *testing.T) {
	c, err := Parse([]byte("models: [{name: m, spill_after: 4s, fallback: [{url: 'http://127.0.0.1:9'}]}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{})}
	s, err := b.Build(Overlay(&Config{}, c))
	if err != nil || s.Models["m"].SpillAfter != 4*time.Second {
		t.Fatalf("from the file: %v %v", s.Models["m"].SpillAfter, err)
	}
	f, err := FromFlags(Flags{Fallbacks: List{"m=http://127.0.0.1:9"}, SpillAfter: List{"m=2500ms"}})
	if err != nil {
		t.Fatal(err)
	}
	if s, err = b.Build(f); err != nil || s.Models["m"].SpillAfter != 2500*time.Millisecond {
		t.Fatalf("from flags: %v %v", s.Models["m"].SpillAfter, err)
	}
	// The two halves from different sources: file and flags merge first.
	fileSpill, err := Parse([]byte("models: [{name: m, spill_after: 3s}]\n"))
	if err != nil {
		t.Fatalf("spill_after in the file, its fallback a flag: %v", err)
	}
	flagFallback, _ := FromFlags(Flags{Fallbacks: List{"m=http://127.0.0.1:9"}})
	if s, err = b.Build(Overlay(flagFallback, fileSpill)); err != nil || s.Models["m"].SpillAfter != 3*time.Second || len(s.Models["m"].Fallback) != 1 {
		t.Fatalf("file spill_after + --fallback: %v %v", s.Models["m"], err)
	}
	flagSpill, err := FromFlags(Flags{SpillAfter: List{"m=2s"}})
	if err != nil {
		t.Fatalf("--spill-after, its fallback in the file: %v", err)
	}
	fileFallback, _ := Parse([]byte("models: [{name: m, fallback: [{url: 'http://127.0.0.1:9'}]}]\n"))
	if s, err = b.Build(Overlay(flagSpill, fileFallback)); err != nil || s.Models["m"].SpillAfter != 2*time.Second {
		t.Fatalf("--spill-after + file fallback: %v %v", s.Models["m"], err)
	}
	for _, bad := range []string{"m", "m=soon", "=5s"} {
		if _, err := FromFlags(Flags{Fallbacks: List{"m=http://127.0.0.1:9"}, SpillAfter: List{bad}}); err == nil {
			t.Errorf("--spill-after %q accepted", bad)
		}
	}
}

// TestReloadKeepsLearnedStaticModelsUntilConfigured: a static upstream
// configured without models keeps, across reloads that leave it alone, the
// models learned from its /v1/models (no window in which it takes any
// model); models configured for it later win over learning; another URL
// forgets what was learned.
func TestReloadKeepsLearnedStaticModelsUntilConfigured(t *testing.T) {
	engine := startEngine(t)
	path := filepath.Join(t.TempDir(), "router.yaml")
	table := fleet.NewTable(fleet.TableConfig{})
	r := &Reloader{Base: &Config{}, Path: path, Builder: &Builder{Table: table}, Log: zerolog.Nop()}
	r.Gateway = gateway.New(table, nil, gateway.Settings{}, zerolog.Nop())
	reload := func(static string) {
		t.Helper()
		doc := "default_tokenizer: builtin\nstatic_upstreams:\n  - " + static + "\n"
		if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := r.Reload(); err != nil {
			t.Fatal(err)
		}
	}
	models := func() string {
		s := table.Snapshot()
		return fmt.Sprint(s.Replicas[s.Find("s")].Models)
	}
	reload(fmt.Sprintf("{name: s, url: %q}", engine))
	r.Gateway.RefreshStaticModels()
	if got := models(); got != "[sim]" {
		t.Fatalf("learned %s", got)
	}
	reload(fmt.Sprintf("{name: s, url: %q}", engine))
	if got := models(); got != "[sim]" {
		t.Fatalf("a reload leaving the static alone reset its learned models to %s (takes any model)", got)
	}
	reload(fmt.Sprintf("{name: s, url: %q, models: [other]}", engine))
	r.Gateway.RefreshStaticModels()
	if got := models(); got != "[other]" {
		t.Fatalf("configured models [other] became %s after discovery", got)
	}
	reload(fmt.Sprintf("{name: s, url: %q}", engine))
	r.Gateway.RefreshStaticModels()
	if got := models(); got != "[sim]" {
		t.Fatalf("models no longer configured, discovery gave %s", got)
	}
	reload("{name: s, url: 'http://127.0.0.1:9'}")
	if got := models(); got != "[]" {
		t.Fatalf("another URL kept the old one's models %s", got)
	}
}

// TestRejectedReloadKeepsThePolicyInForce: a reload that fails to build must
// leave nothing behind; re-applying the configuration in force afterwards
// keeps its policy, and with it the speculative records and learned costs.
func TestRejectedReloadKeepsThePolicyInForce(t *testing.T) {
	table := fleet.NewTable(fleet.TableConfig{})
	b := &Builder{Table: table}
	good := &Config{Policy: "kvaware", DefaultTokenizer: "builtin"}
	s, err := b.Build(good)
	if err != nil {
		t.Fatal(err)
	}
	g := gateway.New(table, nil, s, zerolog.Nop())
	p0 := g.Settings().Policy
	bad := &Config{Policy: "chwbl", DefaultTokenizer: "builtin", APIKeysEnv: "KVMESH_TEST_UNSET_VAR"}
	if err := b.Apply(g, bad); err == nil {
		t.Fatal("a config naming an empty variable applied")
	}
	if err := b.Apply(g, good); err != nil {
		t.Fatal(err)
	}
	if g.Settings().Policy != p0 {
		t.Fatalf("re-applying the config in force after a rejected reload replaced its %s policy", p0.Name())
	}
}

// TestEmptyFileIsNotReloaded: a file caught empty (> router.yaml, a failed
// envsubst) would mean all defaults: client API keys off, every static
// upstream gone. The configuration in force stays.
func TestEmptyFileIsNotReloaded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "router.yaml")
	write := func(s string) {
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("api_keys: [k1]\nstatic_upstreams: [{name: s, url: 'http://127.0.0.1:9', models: [m]}]\n")
	table := fleet.NewTable(fleet.TableConfig{})
	r := &Reloader{Base: &Config{}, Path: path, Builder: &Builder{Table: table}, Log: zerolog.Nop()}
	r.Gateway = gateway.New(table, nil, gateway.Settings{}, zerolog.Nop())
	if err := r.Reload(); err != nil || len(r.Gateway.Settings().APIKeys) != 1 {
		t.Fatal(err)
	}
	for _, empty := range []string{"", "\n# being rewritten\n"} {
		write(empty)
		if err := r.Reload(); err == nil || len(r.Gateway.Settings().APIKeys) != 1 || len(table.Snapshot().Replicas) != 1 {
			t.Fatalf("%q reloaded (%v): API keys %v, %d replicas", empty, err, r.Gateway.Settings().APIKeys, len(table.Snapshot().Replicas))
		}
	}
}

// Load costs of offload tiers parse into routing.Config, media in upper
// case as sidecars announce them.
func TestOffloadPerTokenParses(t *testing.T) {
	c, err := Parse([]byte("routing:\n  offload_per_token: 3us\n  offload_per_token_by_medium:\n    disk: 20us\n"))
	if err != nil {
		t.Fatal(err)
	}
	rc := c.Routing.Config()
	if rc.OffloadPerToken != 3*time.Microsecond || len(rc.OffloadPerTokenBy) != 1 || rc.OffloadPerTokenBy["DISK"] != 20*time.Microsecond {
		t.Fatalf("routing config %+v", rc)
	}
}

func TestDisaggregation(t *testing.T) {
	c, err := Parse([]byte("disaggregation: {split: always, min_prefill: 30ms}\nrouting: {prefill_per_token: 60us}\n"))
	if err != nil {
		t.Fatal(err)
	}
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{})}
	s, err := b.Build(c)
	if err != nil || s.Split != plan.SplitAlways || s.SplitMinUncached != 500 {
		t.Fatalf("split %v, threshold %d tokens, %v", s.Split, s.SplitMinUncached, err)
	}
	if c, err = Parse([]byte("{}\n")); err == nil {
		if s, err = b.Build(c); err != nil || s.Split != plan.SplitAuto || s.SplitMinUncached != 500 {
			t.Fatalf("defaults: split %v, threshold %d tokens (15 ms at 30 µs), %v", s.Split, s.SplitMinUncached, err)
		}
	}
	for _, bad := range []string{"disaggregation: {split: sometimes}\n", "disaggregation: {min_prefill: -1ms}\n"} {
		if c, err := Parse([]byte(bad)); err == nil {
			if _, err := b.Build(c); err == nil {
				t.Errorf("%q accepted", bad)
			}
		}
	}
}
