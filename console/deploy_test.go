package console

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

// The Grafana dashboard, the Prometheus scrape config and the console's
// script all name metrics; these tests hold them to what the router, the
// sidecar and enginesim really export, read from their source.

var metricName = regexp.MustCompile(`\b(kvmesh_[a-z0-9_]+|vllm:[a-z0-9_:]+)`)

// exportedMetrics collects the metric names that the non-test Go source of
// the exporting packages spells out.
func exportedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	literal := regexp.MustCompile(`"((?:kvmesh_|vllm:)[a-z0-9_:]+)"`)
	names := map[string]bool{}
	for _, dir := range []string{"gateway", "sidecar", "enginesim"} {
		files, err := filepath.Glob(filepath.Join("..", dir, "*.go"))
		if err != nil || len(files) == 0 {
			t.Fatalf("no Go source in ../%s (%v)", dir, err)
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range literal.FindAllSubmatch(src, -1) {
				names[string(m[1])] = true
			}
		}
	}
	for _, must := range []string{"kvmesh_router_routes_total", "kvmesh_sidecar_engine_kv_usage", "vllm:prefix_cache_hits_total"} {
		if !names[must] {
			t.Fatalf("source scan missed %s: %d names found", must, len(names))
		}
	}
	return names
}

// known accepts a name the source exports, or a histogram's series of one.
func known(exported map[string]bool, name string) bool {
	if exported[name] {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && exported[base] {
			return true
		}
	}
	return false
}

type dashboard struct {
	UID           string `json:"uid"`
	Title         string `json:"title"`
	SchemaVersion int    `json:"schemaVersion"`
	Templating    struct {
		List []struct {
			Name    string `json:"name"`
			Type    string `json:"type"`
			Query   string `json:"query"`
			Current struct {
				Value string `json:"value"`
			} `json:"current"`
		} `json:"list"`
	} `json:"templating"`
	Panels []struct {
		ID         int    `json:"id"`
		Type       string `json:"type"`
		Title      string `json:"title"`
		Datasource *struct {
			UID string `json:"uid"`
		} `json:"datasource"`
		GridPos struct{ H, W, X, Y int } `json:"gridPos"`
		Targets []struct {
			Expr  string `json:"expr"`
			RefID string `json:"refId"`
		} `json:"targets"`
	} `json:"panels"`
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	raw, err := os.ReadFile("../deploy/grafana/dashboards/kvmesh.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	if dec.More() {
		t.Fatal("dashboard JSON: trailing data")
	}
	return d
}

func TestGrafanaDashboard(t *testing.T) {
	d := readDashboard(t)
	exported := exportedMetrics(t)
	if d.UID == "" || d.Title == "" || d.SchemaVersion < 30 || len(d.Panels) < 10 {
		t.Fatalf("dashboard uid %q title %q schema %d with %d panels", d.UID, d.Title, d.SchemaVersion, len(d.Panels))
	}
	vars := map[string]string{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v.Current.Value
	}
	if vars["datasource"] != "kvmesh-prometheus" {
		t.Errorf("datasource variable defaults to %q, want the provisioned uid kvmesh-prometheus", vars["datasource"])
	}

	ids := map[int]bool{}
	type cell struct{ x, y int }
	used := map[cell]string{}
	referenced := map[string]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("%q: grid position %+v outside the 24 columns", p.Title, g)
		}
		for x := g.X; x < g.X+g.W; x++ {
			for y := g.Y; y < g.Y+g.H; y++ {
				if other, ok := used[cell{x, y}]; ok {
					t.Errorf("%q overlaps %q at %d,%d", p.Title, other, x, y)
				}
				used[cell{x, y}] = p.Title
			}
		}
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("%q: datasource %+v, want the ${datasource} variable", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("%q has no query", p.Title)
		}
		refs := map[string]bool{}
		for _, q := range p.Targets {
			if refs[q.RefID] {
				t.Errorf("%q: refId %s twice", p.Title, q.RefID)
			}
			refs[q.RefID] = true
			if err := balanced(q.Expr); err != "" {
				t.Errorf("%q: %s in %s", p.Title, err, q.Expr)
			}
			names := metricName.FindAllString(q.Expr, -1)
			if len(names) == 0 {
				t.Errorf("%q: query names no metric: %s", p.Title, q.Expr)
			}
			for _, n := range names {
				referenced[n] = true
				if !known(exported, n) {
					t.Errorf("%q: %s is exported by no router, sidecar or engine", p.Title, n)
				}
			}
		}
	}
	// The dashboard shows what the issue asks for.
	for _, n := range []string{
		"kvmesh_router_prompt_tokens_total", "kvmesh_router_actual_cached_tokens_total",
		"kvmesh_router_predicted_cached_tokens_total", "kvmesh_router_degradations_total",
		"kvmesh_router_routes_total", "kvmesh_sidecar_engine_kv_usage",
	} {
		if !referenced[n] {
			t.Errorf("dashboard never queries %s", n)
		}
	}
	var list []string
	for n := range referenced {
		list = append(list, n)
	}
	sort.Strings(list)
	t.Logf("%d panels over %d metrics", len(d.Panels), len(list))
}

// balanced checks (), {} and [] nest, outside quoted strings.
func balanced(expr string) string {
	var stack []rune
	pair := map[rune]rune{')': '(', '}': '{', ']': '['}
	quoted := false
	for _, r := range expr {
		switch {
		case r == '"':
			quoted = !quoted
		case quoted:
		case r == '(' || r == '{' || r == '[':
			stack = append(stack, r)
		case pair[r] != 0:
			if len(stack) == 0 || stack[len(stack)-1] != pair[r] {
				return "unbalanced " + string(r)
			}
			stack = stack[:len(stack)-1]
		}
	}
	if quoted || len(stack) > 0 {
		return "unclosed bracket or quote"
	}
	return ""
}

func TestConsoleScriptMetrics(t *testing.T) {
	exported := exportedMetrics(t)
	names := metricName.FindAllString(string(assets["console.js"].body), -1)
	if len(names) < 5 {
		t.Fatalf("console.js names %d metrics: %v", len(names), names)
	}
	for _, n := range names {
		if !known(exported, n) {
			t.Errorf("console.js reads %s, which the router does not export", n)
		}
	}
}

func TestPrometheusAndProvisioning(t *testing.T) {
	var prom struct {
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			MetricsPath   string `yaml:"metrics_path"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	readYAML(t, "../deploy/prometheus/prometheus.yml", &prom)
	jobs := map[string]int{}
	hostPort := regexp.MustCompile(`^[a-z0-9-]+:[0-9]+$`)
	for _, sc := range prom.ScrapeConfigs {
		for _, s := range sc.StaticConfigs {
			for _, tg := range s.Targets {
				if !hostPort.MatchString(tg) {
					t.Errorf("job %s: target %q is not host:port", sc.JobName, tg)
				}
				jobs[sc.JobName]++
			}
		}
	}
	// The dashboard's job variables default to these job names.
	d := readDashboard(t)
	for _, v := range d.Templating.List {
		if strings.HasSuffix(v.Name, "_job") && jobs[v.Query] == 0 {
			t.Errorf("dashboard variable %s defaults to job %q, which prometheus.yml does not scrape (%v)", v.Name, v.Query, jobs)
		}
	}

	var ds struct {
		Datasources []struct{ Name, UID, Type, URL string } `yaml:"datasources"`
	}
	readYAML(t, "../deploy/grafana/provisioning/datasources/prometheus.yml", &ds)
	if len(ds.Datasources) != 1 || ds.Datasources[0].UID != "kvmesh-prometheus" || ds.Datasources[0].Type != "prometheus" {
		t.Errorf("provisioned datasources: %+v", ds.Datasources)
	}
	var prov struct {
		Providers []struct {
			Options struct{ Path string } `yaml:"options"`
		} `yaml:"providers"`
	}
	readYAML(t, "../deploy/grafana/provisioning/dashboards/kvmesh.yml", &prov)
	if len(prov.Providers) != 1 || prov.Providers[0].Options.Path != "/var/lib/grafana/dashboards" {
		t.Errorf("dashboard provider: %+v", prov.Providers)
	}
}

// The monitoring profile of docker-compose.yml runs only on request and
// mounts files that exist.
func TestComposeMonitoringProfile(t *testing.T) {
	var compose struct {
		Services map[string]struct {
			Image    string   `yaml:"image"`
			Profiles []string `yaml:"profiles"`
			Volumes  []string `yaml:"volumes"`
		} `yaml:"services"`
	}
	readYAML(t, "../docker-compose.yml", &compose)
	for _, name := range []string{"prometheus", "grafana"} {
		s, ok := compose.Services[name]
		if !ok {
			t.Errorf("docker-compose.yml has no %s service", name)
			continue
		}
		if len(s.Profiles) != 1 || s.Profiles[0] != "monitoring" {
			t.Errorf("%s profiles %v, want [monitoring]", name, s.Profiles)
		}
		for _, v := range s.Volumes {
			host, _, _ := strings.Cut(v, ":")
			if _, err := os.Stat(filepath.Join("..", host)); err != nil {
				t.Errorf("%s mounts %s: %v", name, host, err)
			}
		}
	}
	for name, s := range compose.Services {
		if name != "prometheus" && name != "grafana" && len(s.Profiles) > 0 {
			t.Errorf("%s moved into profiles %v", name, s.Profiles)
		}
	}
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// TestAlertRules: every alert in deploy/prometheus/alerts.yml queries only
// metrics kvmesh exports, with balanced brackets, a severity and a summary;
// the demo's Prometheus loads the file from where compose mounts it.
func TestAlertRules(t *testing.T) {
	var rules struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				For         string            `yaml:"for"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	readYAML(t, "../deploy/prometheus/alerts.yml", &rules)
	exported := exportedMetrics(t)
	seen := map[string]bool{}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if r.Alert == "" || seen[r.Alert] {
				t.Errorf("group %s: alert name %q missing or repeated", g.Name, r.Alert)
			}
			seen[r.Alert] = true
			if err := balanced(r.Expr); err != "" {
				t.Errorf("%s: %s in %s", r.Alert, err, r.Expr)
			}
			names := metricName.FindAllString(r.Expr, -1)
			if len(names) == 0 {
				t.Errorf("%s: queries no metric", r.Alert)
			}
			for _, m := range names {
				if !known(exported, m) {
					t.Errorf("%s: %s is exported by no router, sidecar or engine", r.Alert, m)
				}
			}
			if s := r.Labels["severity"]; s != "critical" && s != "warning" && s != "info" {
				t.Errorf("%s: severity %q", r.Alert, s)
			}
			if r.Annotations["summary"] == "" {
				t.Errorf("%s: no summary", r.Alert)
			}
			if r.For != "" {
				if _, err := time.ParseDuration(r.For); err != nil {
					t.Errorf("%s: for %q: %v", r.Alert, r.For, err)
				}
			}
		}
	}
	if n < 5 {
		t.Fatalf("%d alerts", n)
	}
	var prom struct {
		RuleFiles []string `yaml:"rule_files"`
	}
	readYAML(t, "../deploy/prometheus/prometheus.yml", &prom)
	var compose struct {
		Services map[string]struct {
			Volumes []string `yaml:"volumes"`
		} `yaml:"services"`
	}
	readYAML(t, "../docker-compose.yml", &compose)
	mounted := map[string]string{}
	for _, v := range compose.Services["prometheus"].Volumes {
		host, rest, _ := strings.Cut(v, ":")
		inside, _, _ := strings.Cut(rest, ":")
		mounted[inside] = host
	}
	if len(prom.RuleFiles) != 1 || mounted[prom.RuleFiles[0]] != "./deploy/prometheus/alerts.yml" {
		t.Errorf("prometheus.yml loads %v; compose mounts %v", prom.RuleFiles, mounted)
	}
}
