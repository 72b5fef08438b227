package console_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/chromedp"

	"github.com/kvmesh/kvmesh/loadtest/cluster"
)

const adminToken = "console-test-token"

// chromium finds Debian's chromium (or another Chrome) for the browser test;
// KVMESH_CHROMIUM names one explicitly.
func chromium() string {
	if p := os.Getenv("KVMESH_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "headless-shell"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// artifactDir is where the screenshot and the cluster's logs stay after the
// test: a new kvmesh-console-* directory in $KVMESH_ARTIFACTS or in the
// system's temporary directory.
func artifactDir(t *testing.T) string {
	base := os.Getenv("KVMESH_ARTIFACTS")
	if base != "" {
		if err := os.MkdirAll(base, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A fresh directory per run: the process logs are checked below.
	dir, err := os.MkdirTemp(base, "kvmesh-console-")
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

type replica struct {
	Name             string `json:"name"`
	Online           bool   `json:"online"`
	FilterGeneration uint64 `json:"filter_generation"`
	FilterKeys       int    `json:"filter_keys"`
}

func replicas(ctx context.Context, router string) (map[string]replica, error) {
	req, _ := http.NewRequestWithContext(ctx, "GET", router+"/admin/replicas", nil)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer res.Body.Close()
	var list []replica
	if err := json.NewDecoder(res.Body).Decode(&list); err != nil {
		return nil, err
	}
	out := map[string]replica{}
	for _, r := range list {
		out[r.Name] = r
	}
	return out, nil
}

func get(t *testing.T, url string) string {
	t.Helper()
	res, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

type sample struct {
	Labels map[string]string `json:"labels"`
	Value  string            `json:"value"`
}

// goParse reads Prometheus text with Prometheus' own parser: the kvmesh_
// counters, gauges and untyped series, values spelt as JavaScript's
// String(number) does.
func goParse(t *testing.T, text string) map[string][]sample {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("expfmt: %v", err)
	}
	out := map[string][]sample{}
	for name, f := range families {
		if !strings.HasPrefix(name, "kvmesh_") {
			continue
		}
		for _, m := range f.GetMetric() {
			var v float64
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				v = m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				v = m.GetGauge().GetValue()
			case dto.MetricType_UNTYPED:
				v = m.GetUntyped().GetValue()
			default:
				continue // histograms: the page reads none
			}
			s := sample{Labels: map[string]string{}, Value: jsNumber(v)}
			for _, l := range m.GetLabel() {
				s.Labels[l.GetName()] = l.GetValue()
			}
			out[name] = append(out[name], s)
		}
		sortSamples(out[name])
	}
	return out
}

func jsNumber(v float64) string {
	switch {
	case math.IsNaN(v):
		return "NaN"
	case math.IsInf(v, 1):
		return "Infinity"
	case math.IsInf(v, -1):
		return "-Infinity"
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}

func sampleKey(s sample) string {
	keys := make([]string, 0, len(s.Labels))
	for k, v := range s.Labels {
		keys = append(keys, k+"="+strconv.Quote(v))
	}
	sort.Strings(keys)
	return strings.Join(keys, ",")
}

func sortSamples(s []sample) {
	sort.Slice(s, func(i, j int) bool { return sampleKey(s[i]) < sampleKey(s[j]) })
}

func equalSamples(a, b []sample) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if sampleKey(a[i]) != sampleKey(b[i]) || a[i].Value != b[i].Value {
			return false
		}
	}
	return true
}

// fleetState is the router's and the sidecars' view, for a failure message.
func fleetState(router string, sidecars []string) string {
	var b strings.Builder
	for _, u := range append([]string{router + "/admin/replicas"}, sidecars...) {
		if !strings.Contains(u, "/admin/") {
			u += "/status"
		}
		res, err := http.Get(u)
		if err != nil {
			fmt.Fprintf(&b, "%s: %v\n", u, err)
			continue
		}
		body, _ := io.ReadAll(io.LimitReader(res.Body, 8<<10))
		res.Body.Close()
		fmt.Fprintf(&b, "%s: %s\n", u, body)
	}
	return b.String()
}

// sendRound sends one completion for each of four long prefixes and returns
// the cached tokens the router predicted for them.
func sendRound(ctx context.Context, router string, round int) (predicted int, err error) {
	for p := range 4 {
		prefix := strings.Repeat(fmt.Sprintf("Prefix %d: the console shows which replica holds which prefix. ", p), 40)
		body, _ := json.Marshal(map[string]any{
			"model": "sim", "prompt": fmt.Sprintf("%s Question %d: what is cached?", prefix, round), "max_tokens": 4,
		})
		req, _ := http.NewRequestWithContext(ctx, "POST", router+"/v1/completions", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return predicted, err
		}
		res.Body.Close()
		if res.StatusCode != 200 {
			return predicted, fmt.Errorf("completion %d/%d: status %d", round, p, res.StatusCode)
		}
		var c int
		fmt.Sscan(res.Header.Get("X-Kvmesh-Cached-Tokens"), &c)
		predicted += c
	}
	return predicted, nil
}

// demoTraffic keeps eight clients busy for d with a mix a real fleet sees:
// a few shared system prompts (hits after their first request) and some
// one-off prompts (cold).
func demoTraffic(ctx context.Context, router string, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				prompt := fmt.Sprintf("One-off question %d from client %d about %d things.", i, w, i*7919%1000)
				if i%4 != 3 {
					prompt = strings.Repeat(fmt.Sprintf("System prompt %d: you answer questions about fleet number %d. ", (i+w)%5, (i+w)%5), 30+10*((i+w)%5)) + prompt
				}
				body, _ := json.Marshal(map[string]any{"model": "sim", "prompt": prompt, "max_tokens": 160})
				req, _ := http.NewRequestWithContext(ctx, "POST", router+"/v1/completions", bytes.NewReader(body))
				res, err := http.DefaultClient.Do(req)
				if err != nil {
					if ctx.Err() == nil {
						errs <- err
					}
					return
				}
				res.Body.Close()
				time.Sleep(time.Duration(50+(i*37)%150) * time.Millisecond)
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// TestConsoleInBrowser loads the status page of a real router (three
// enginesim replicas with sidecars, two selected for prefix matching, from
// make build's bin/) in headless Chromium: no console errors, the replicas
// listed with the unselected one dimmed, the hit rate moves after traffic,
// and the per-replica clear button, after asking for the admin token, clears
// that replica's route records cluster-wide.
func TestConsoleInBrowser(t *testing.T) {
	exe := chromium()
	if exe == "" {
		t.Skip("no Chromium: install Debian's chromium package (apt-get install -y chromium) or set KVMESH_CHROMIUM to run the browser test")
	}
	bin := os.Getenv("KVMESH_BIN") // default: the repository's bin/
	if bin == "" {
		bin = filepath.Join("..", "bin")
	}
	bin, err := filepath.Abs(bin)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"enginesim", "sidecar", "router"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			t.Skipf("no %s in %s: run make build first", b, bin)
		}
	}
	// KVMESH_CONSOLE_DEMO=90s runs that long on a slower clock with mixed
	// traffic before the screenshot: the picture in docs/console.png.
	var demo time.Duration
	if d := os.Getenv("KVMESH_CONSOLE_DEMO"); d != "" {
		if demo, err = time.ParseDuration(d); err != nil {
			t.Fatalf("KVMESH_CONSOLE_DEMO: %v", err)
		}
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second+demo)
	defer cancel()
	out := artifactDir(t)
	t.Logf("artifacts (screenshot, process logs): %s", out)

	// Three replicas, two selected for prefix matching: the third is routed
	// by load only and must show so.
	config := filepath.Join(t.TempDir(), "router.yaml")
	if err := os.WriteFile(config, []byte("selection: [replica-0, replica-1]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	timeScale := 0.05
	if demo > 0 {
		timeScale = 1
	}
	cl, err := cluster.Start(ctx, cluster.Config{
		BinDir: bin, OutDir: out, Replicas: 3, Routers: 1, Policy: "kvaware",
		TimeScale: timeScale, ReadyTimeout: 30 * time.Second, Grace: 3 * time.Second,
		RouterArgs: []string{"--admin-token", adminToken, "--config", config},
	})
	if err != nil {
		t.Fatalf("starting the cluster: %v", err)
	}
	defer cl.Stop()
	router := cl.Routers[0]
	if res, err := http.Get(router + "/"); err != nil {
		t.Fatal(err)
	} else if res.Body.Close(); res.StatusCode == http.StatusNotFound {
		t.Skipf("%s/router predates the console (GET / is 404): run make build", bin)
	}
	t.Logf("cluster up in %v: router %s, replicas %v", time.Since(start).Round(time.Millisecond), router, cl.Names)

	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.WindowSize(1360, 900), chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(t.TempDir()),
	)...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(alloc)
	defer cancelBrowser()

	// Start the browser on bctx, so that it lives as long as bctx and not
	// as long as the console subscription below.
	if err := chromedp.Do(bctx, chromedp.Navigate("about:blank")); err != nil {
		t.Fatalf("starting %s: %v", exe, err)
	}
	t.Logf("browser up at %v", time.Since(start).Round(time.Millisecond))

	// Collect the console from before the page loads.
	var mu sync.Mutex
	var messages []chromedp.ConsoleMessage
	consoleCtx, stopConsole := context.WithCancel(bctx)
	defer stopConsole()
	msgs := chromedp.Console(consoleCtx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m, err := range msgs {
			if err != nil {
				return
			}
			mu.Lock()
			messages = append(messages, m)
			mu.Unlock()
		}
	}()

	step := func(name string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(bctx, actions...); err != nil {
			t.Fatalf("%s: %v (after %v)", name, err, time.Since(start).Round(time.Millisecond))
		}
	}
	poll := func(name, expr string, timeout time.Duration) {
		t.Helper()
		step(name, func(ctx context.Context, tg *chromedp.Target) (chromedp.Void, error) {
			_, err := chromedp.Poll[chromedp.Void](expr, chromedp.WithPollingTimeout(timeout),
				chromedp.WithPollingInterval(100*time.Millisecond))(ctx, tg)
			return chromedp.Void{}, err
		})
	}
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("reading %s: %v", sel, err)
		}
		return s
	}

	step("loading the page", chromedp.Navigate(router+"/"))
	poll("waiting for the replicas", `document.querySelectorAll('#replica-rows tr[data-replica]').length === 3 &&
		window.kvmeshConsole.state.polls >= 2`, 10*time.Second)
	for i, name := range cl.Names {
		row := `tr[data-replica="` + name + `"]`
		if s := text(row + ` td.name strong`); s != name {
			t.Errorf("row of %s shows %q", name, s)
		}
		// Stale is online with state older than the TTL: a busy machine
		// may show it for a moment.
		if s := text(row + ` .pill`); s != "online" && s != "stale" {
			t.Errorf("%s shows status %q, want online", name, s)
		}
		wantSel := "selected"
		if i == 2 {
			wantSel = "load only"
		}
		if s := text(row + ` td:nth-child(5) .pill`); s != wantSel {
			t.Errorf("%s shows prefix routing %q, want %q", name, s, wantSel)
		}
		dimmed, err := chromedp.Run(bctx, chromedp.Evaluate[bool](`(() => { const r = document.querySelector('`+row+`');
			return r.classList.contains('unselected') && getComputedStyle(r.querySelector('td.name .why')).display !== 'none' &&
				getComputedStyle(r.querySelector('td:nth-child(2)')).opacity < 1 })()`))
		if err != nil || dimmed != (i == 2) {
			t.Errorf("%s dimmed with the load-only note: %v, want %v (%v)", name, dimmed, i == 2, err)
		}
	}
	if s, o := text("#selected-count"), text("#online-count"); s != "2" || o != "3" {
		t.Errorf("selected %q of %q online, want 2 of 3", s, o)
	}
	hitBefore := text("#hit-actual")

	// One cold round; once the sidecars' filters reach the router, three
	// rounds that find their prefixes.
	if _, err := sendRound(ctx, router, 0); err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	// The sidecars' filters reach the router within a few hundred ms
	// (gossip): send rounds until one is predicted cached, then two more.
	predicted, rounds, firstHit := 0, 0, -1
	for round := 1; firstHit < 0 || round <= firstHit+2; round++ {
		p, err := sendRound(ctx, router, round)
		if err != nil {
			t.Fatal(err)
		}
		predicted, rounds = predicted+p, round
		if p > 0 && firstHit < 0 {
			firstHit = round
		}
		if firstHit < 0 && time.Since(sent) > 10*time.Second {
			t.Fatalf("the router predicted no cached tokens in %d rounds over 4 warm prefixes (10 s)\n%s", round, fleetState(router, cl.Sidecars))
		}
		if firstHit < 0 {
			time.Sleep(100 * time.Millisecond)
		}
	}
	t.Logf("first predicted hit in round %d, %v after the cold round", firstHit, time.Since(sent).Round(10*time.Millisecond))
	poll("waiting for the hit rate", `(() => { const h = window.kvmeshConsole.hitRate();
		return h && h.actual > 0 && h.predicted > 0 && /%$/.test(document.getElementById('hit-actual').textContent) })()`, 10*time.Second)
	hitAfter, predAfter := text("#hit-actual"), text("#hit-predicted")
	t.Logf("hit rate on the page: %q before traffic, %q actual / %q predicted after %d requests (router predicted %d cached tokens)",
		hitBefore, hitAfter, predAfter, 4*(rounds+1), predicted)
	if hitBefore == hitAfter {
		t.Errorf("hit rate did not move: %q", hitAfter)
	}
	if s := text("#saved-total"); s == "–" || s == "0" {
		t.Errorf("tokens saved %q after cached traffic", s)
	}

	// Clear one replica's records through its button: the router wants a
	// token, the page asks for it, and the replica's filter is rebuilt.
	before, err := replicas(ctx, router)
	if err != nil {
		t.Fatal(err)
	}
	target := cl.Names[0]
	step("clicking clear", chromedp.Click(chromedp.CSS(`button[data-clear="`+target+`"]`)))
	poll("waiting for the token prompt", `document.getElementById('token-dialog').open &&
		document.getElementById('token-error').hidden`, 5*time.Second)
	// A wrong token first: the router refuses it and the page asks again.
	step("entering a wrong token",
		chromedp.SendKeys(chromedp.CSS("#token-input"), "not-the-token"),
		chromedp.Click(chromedp.CSS("#token-submit")))
	poll("waiting for the token to be refused", `document.getElementById('token-dialog').open &&
		!document.getElementById('token-error').hidden && document.getElementById('token-input').value === ''`, 5*time.Second)
	step("entering the token",
		chromedp.SendKeys(chromedp.CSS("#token-input"), adminToken),
		chromedp.Click(chromedp.CSS("#token-submit")))
	poll("waiting for the confirmation", `[...document.querySelectorAll('.toast')].some(e => e.textContent.includes('cleared for `+target+`'))`, 5*time.Second)
	// What changed, from the router's answer, in the toast and kept beside
	// the button once the toast is gone.
	const changed = ` filter keys dropped here. Its requests are routed by load until its sidecar publishes a fresh filter`
	poll("waiting for what the clear changed", `[...document.querySelectorAll('.toast')].some(e => /cleared for `+target+` on every router: [0-9,]+`+changed+`/.test(e.textContent))`, 5*time.Second)
	if s := text("#clear-last"); !strings.HasPrefix(s, "Last clear, at ") || !strings.Contains(s, "cleared for "+target+" on every router: ") || !strings.Contains(s, changed) {
		t.Errorf("beside the button after the clear: %q, want what it changed", s)
	}
	var after map[string]replica
	for deadline := time.Now().Add(8 * time.Second); ; {
		if after, err = replicas(ctx, router); err != nil {
			t.Fatal(err)
		}
		if after[target].FilterGeneration > before[target].FilterGeneration {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: filter generation still %d after the clear (before %d)", target, after[target].FilterGeneration, before[target].FilterGeneration)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("%s: filter generation %d → %d, keys %d → %d", target,
		before[target].FilterGeneration, after[target].FilterGeneration, before[target].FilterKeys, after[target].FilterKeys)
	if log, err := os.ReadFile(filepath.Join(out, "router-0.log")); err != nil || !bytes.Contains(log, []byte(`"replicas":["`+target+`"]`)) {
		t.Errorf("router log has no clear of %s only (%v)", target, err)
	}
	stored, err := chromedp.Run(bctx, chromedp.Evaluate[string](`sessionStorage.getItem('kvmesh.adminToken') || ''`))
	if err != nil || stored != adminToken {
		t.Errorf("token kept in sessionStorage: %q (%v)", stored, err)
	}

	// Clearing every replica takes two clicks, and the kept token.
	step("clear all, first click", chromedp.Click(chromedp.CSS("#clear-all")))
	if s := text("#clear-all"); s != "Confirm: clear all?" {
		t.Errorf("after one click the clear-all button says %q", s)
	}
	step("clear all, second click", chromedp.Click(chromedp.CSS("#clear-all")))
	poll("waiting for the clear-all confirmation", `[...document.querySelectorAll('.toast')].some(e => e.textContent.includes('cleared for all replicas'))`, 5*time.Second)
	if s := text("#clear-last"); !strings.Contains(s, "cleared for all replicas on every router: ") || !strings.Contains(s, " over ") {
		t.Errorf("beside the button after clearing all: %q, want the keys dropped over every replica", s)
	}
	if log, err := os.ReadFile(filepath.Join(out, "router-0.log")); err != nil || !bytes.Contains(log, []byte(`"replicas":"all"`)) {
		t.Errorf("router log has no clear of all replicas (%v)", err)
	}

	// The page's Prometheus text parser agrees with Prometheus' own, on the
	// router's real /metrics and on escapes, specials and timestamps.
	metricsText := get(t, router+"/metrics")
	crafted := `# HELP kvmesh_x_total help with \\ and \n escapes` + "\n# TYPE kvmesh_x_total counter\n" +
		`kvmesh_x_total{mode="pre\"fix",path="a\\b",nl="x\ny"} 3 1700000000000` + "\n" +
		`kvmesh_x_total{mode="balance"} 1.5e3` + "\n" +
		"kvmesh_y NaN\nkvmesh_z +Inf\nkvmesh_v -Inf\n" + `kvmesh_w{a="}",b=",",c="{x=1}"} -2` + "\n"
	for name, input := range map[string]string{"router /metrics": metricsText, "crafted": crafted} {
		want := goParse(t, input)
		lit, _ := json.Marshal(input)
		got, err := chromedp.Run(bctx, chromedp.Evaluate[map[string][]sample](`(() => {
			const m = window.kvmeshConsole.parseMetrics(`+string(lit)+`);
			return Object.fromEntries([...m].map(([k, v]) => [k, v.map(s => ({labels: s.labels, value: String(s.value)}))]));
		})()`))
		if err != nil {
			t.Fatal(err)
		}
		compared := 0
		for family, samples := range want {
			g := got[family]
			sortSamples(g)
			if !equalSamples(g, samples) {
				t.Errorf("%s: %s: page parsed %v, Prometheus %v", name, family, g, samples)
			}
			compared += len(samples)
		}
		if compared == 0 {
			t.Errorf("%s: nothing compared", name)
		}
		t.Logf("parser agrees with expfmt on %d samples of %s", compared, name)
	}
	t.Logf("one poll reads %d bytes of /metrics and %d of /admin/replicas (uncompressed)",
		len(metricsText), len(get(t, router+"/admin/replicas")))

	// Let the page show the rebuilt filter (in a demo, the traffic still
	// running), then keep a picture.
	var demoErr chan error
	if demo > 0 {
		demoErr = make(chan error, 1)
		go func() { demoErr <- demoTraffic(ctx, router, demo+5*time.Second) }()
		time.Sleep(demo)
	}
	time.Sleep(2200 * time.Millisecond)
	png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	shot := filepath.Join(out, "console.png")
	if err := os.WriteFile(shot, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d KB)", shot, len(png)>>10)
	if demoErr != nil {
		if err := <-demoErr; err != nil {
			t.Fatal(err)
		}
	}

	// A phone-sized screen in the dark scheme: nothing but the table's own
	// scroller may be wider than the screen.
	step("narrow and dark", chromedp.EmulateViewport(400, 860),
		chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			_, err := cdp.Call(ctx, tg, emulation.SetEmulatedMedia, emulation.SetEmulatedMediaParams{
				Features: []*emulation.MediaFeature{{Name: "prefers-color-scheme", Value: "dark"}},
			})
			return err
		}), chromedp.Sleep(400*time.Millisecond))
	layout, err := chromedp.Run(bctx, chromedp.Evaluate[struct {
		ScrollWidth, InnerWidth int
		Background              string
	}](`({ScrollWidth: document.documentElement.scrollWidth, InnerWidth: window.innerWidth,
		Background: getComputedStyle(document.body).backgroundColor})`))
	if err != nil {
		t.Fatal(err)
	}
	if layout.ScrollWidth > layout.InnerWidth {
		wide, _ := chromedp.Run(bctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > window.innerWidth + 1).slice(0, 8).map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right))`))
		t.Errorf("at %d px the page is %d px wide; beyond: %v", layout.InnerWidth, layout.ScrollWidth, wide)
	}
	if layout.Background != "rgb(11, 17, 32)" {
		t.Errorf("dark scheme background %s", layout.Background)
	}
	if png, err = chromedp.Run(bctx, chromedp.FullScreenshot(100)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(out, "console-narrow-dark.png"), png, 0o644); err != nil {
		t.Fatal(err)
	}

	pollState, err := chromedp.Run(bctx, chromedp.Evaluate[struct {
		Polls, Errors int
		LastError     string
	}](`({Polls: kvmeshConsole.state.polls, Errors: kvmeshConsole.state.errors, LastError: kvmeshConsole.state.lastError})`))
	if err != nil {
		t.Fatal(err)
	}
	if pollState.Errors != 0 {
		t.Errorf("%d failed polls, last: %s", pollState.Errors, pollState.LastError)
	}

	stopConsole()
	<-done
	mu.Lock()
	defer mu.Unlock()
	unauthorized := 0
	for _, m := range messages {
		// Chrome logs every 4xx answer to fetch; the ones expected are the
		// router asking for its admin token.
		if m.Source == "network" && strings.Contains(m.Text, "401") && strings.Contains(m.URL, "/admin/routes/clear") {
			unauthorized++
			continue
		}
		if m.Type == chromedp.ConsoleError || m.Type == chromedp.ConsoleException || m.Type == chromedp.ConsoleWarning {
			t.Errorf("console %s: %s (%s:%d)", m.Type, m.Text, m.URL, m.Line)
		}
	}
	if unauthorized != 2 {
		t.Errorf("%d 401s logged for the clear, want exactly 2 (no token, then a wrong one)", unauthorized)
	}
	t.Logf("%d console messages, %d polls, test took %v", len(messages), pollState.Polls, time.Since(start).Round(time.Millisecond))

	// The router goes away: the page says so and keeps the last fleet view.
	cl.Stop()
	poll("waiting for the unreachable badge", `document.getElementById('live').dataset.state === 'error' &&
		document.getElementById('live-text').textContent.includes('unreachable')`, 6*time.Second)
	if rows, err := chromedp.Run(bctx, chromedp.Evaluate[int](`document.querySelectorAll('#replica-rows tr[data-replica]').length`)); err != nil || rows != 3 {
		t.Errorf("after the router stopped the table has %d rows (%v), want the last 3", rows, err)
	}
	if err := ctx.Err(); errors.Is(err, context.DeadlineExceeded) {
		t.Fatal("over the 60 s budget")
	}
}
