package console

import (
	"bytes"
	"compress/gzip"
	"io"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

type reply struct {
	status int
	header map[string]string
	body   []byte
}

func serve(method, uri string, header ...string) reply {
	var ctx fasthttp.RequestCtx
	ctx.Request.Header.SetMethod(method)
	ctx.Request.SetRequestURI(uri)
	for i := 0; i+1 < len(header); i += 2 {
		ctx.Request.Header.Set(header[i], header[i+1])
	}
	Handler(&ctx)
	r := reply{status: ctx.Response.StatusCode(), header: map[string]string{}, body: bytes.Clone(ctx.Response.Body())}
	for k, v := range ctx.Response.Header.All() {
		r.header[string(k)] = string(v)
	}
	return r
}

func TestPageAndAssets(t *testing.T) {
	page := serve("GET", "/")
	if page.status != 200 || page.header["Content-Type"] != "text/html; charset=utf-8" {
		t.Fatalf("GET / = %d %q", page.status, page.header["Content-Type"])
	}
	if csp := page.header["Content-Security-Policy"]; !strings.Contains(csp, "script-src 'self'") || !strings.Contains(csp, "connect-src 'self'") {
		t.Errorf("page CSP = %q", csp)
	}
	if page.header["Cache-Control"] != "no-cache" || page.header["Etag"] == "" {
		t.Errorf("caching headers: %v", page.header)
	}
	// Every asset the page references is served, with its type.
	refs := regexp.MustCompile(`(?:src|href)="(/[^"]*)"`).FindAllStringSubmatch(string(page.body), -1)
	want := map[string]string{".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
	seen := 0
	for _, m := range refs {
		ref := m[1]
		if !strings.HasPrefix(ref, Prefix) {
			continue // links to /admin/replicas and /metrics
		}
		seen++
		r := serve("GET", ref)
		ext := ref[strings.LastIndexByte(ref, '.'):]
		if r.status != 200 || r.header["Content-Type"] != want[ext] || len(r.body) == 0 {
			t.Errorf("GET %s = %d %q (%d bytes)", ref, r.status, r.header["Content-Type"], len(r.body))
		}
		if _, ok := r.header["Content-Security-Policy"]; ok {
			t.Errorf("%s carries the page's CSP", ref)
		}
	}
	if seen != 4 { // icon twice, stylesheet, script
		t.Errorf("page references %d console assets, want 4: %v", seen, refs)
	}
}

// The page must work on a cluster without internet: nothing it loads may
// come from another origin.
func TestNoOutsideAssets(t *testing.T) {
	outside := regexp.MustCompile(`(?i)(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?(https?:)?//|@import|fetch\(\s*["'\x60]https?:`)
	for name, a := range assets {
		if m := outside.Find(a.body); m != nil {
			t.Errorf("%s loads from outside: %q", name, m)
		}
	}
}

func TestRevalidation(t *testing.T) {
	first := serve("GET", "/console/console.js")
	etag := first.header["Etag"]
	for _, inm := range []string{etag, "W/" + etag, `"other", ` + etag, "*"} {
		r := serve("GET", "/console/console.js", "If-None-Match", inm)
		if r.status != 304 || len(r.body) != 0 {
			t.Errorf("If-None-Match %s: %d with %d bytes, want 304 and none", inm, r.status, len(r.body))
		}
	}
	if r := serve("GET", "/console/console.js", "If-None-Match", `"stale"`); r.status != 200 || !bytes.Equal(r.body, first.body) {
		t.Errorf("stale tag: %d", r.status)
	}
	if serve("GET", "/console/console.css").header["Etag"] == etag {
		t.Error("two files share an ETag")
	}
}

func TestGzip(t *testing.T) {
	plain := serve("GET", "/console/console.js")
	zipped := serve("GET", "/console/console.js", "Accept-Encoding", "br, gzip")
	if zipped.header["Content-Encoding"] != "gzip" || len(zipped.body) >= len(plain.body) {
		t.Fatalf("gzip: encoding %q, %d bytes vs %d plain", zipped.header["Content-Encoding"], len(zipped.body), len(plain.body))
	}
	zr, err := gzip.NewReader(bytes.NewReader(zipped.body))
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(zr)
	if err != nil || !bytes.Equal(got, plain.body) {
		t.Fatalf("gunzipped body differs (%v)", err)
	}
	if plain.header["Content-Encoding"] != "" || plain.header["Vary"] != "Accept-Encoding" {
		t.Errorf("plain reply headers: %v", plain.header)
	}
}

func TestHeadAndMethods(t *testing.T) {
	get := serve("GET", "/")
	head := serve("HEAD", "/")
	if head.status != 200 || len(head.body) != 0 || head.header["Content-Length"] != strconv.Itoa(len(get.body)) {
		t.Errorf("HEAD /: %d, %d bytes, length %q (GET has %d)", head.status, len(head.body), head.header["Content-Length"], len(get.body))
	}
	for _, m := range []string{"POST", "PUT", "DELETE"} {
		r := serve(m, "/")
		if r.status != 405 || r.header["Allow"] != "GET, HEAD" {
			t.Errorf("%s /: %d, Allow %q", m, r.status, r.header["Allow"])
		}
	}
}

func TestNotFound(t *testing.T) {
	for _, p := range []string{"/console/", "/console/index.html", "/console/nope.js", "/console/static/console.js", "/console/../console/console.js.map"} {
		if r := serve("GET", p); r.status != 404 {
			t.Errorf("GET %s = %d, want 404", p, r.status)
		}
	}
}

func TestOwns(t *testing.T) {
	for p, want := range map[string]bool{
		"/": true, "/console/console.js": true, "/console/": true,
		"": false, "/console": false, "/v1/models": false, "/metrics": false, "/admin/replicas": false, "//": false,
	} {
		if Owns([]byte(p)) != want {
			t.Errorf("Owns(%q) = %v", p, !want)
		}
	}
}

// FuzzHandler: any path, method and validators give one of the page's
// answers, never a panic.
func FuzzHandler(f *testing.F) {
	f.Add("GET", "/", "")
	f.Add("HEAD", "/console/console.css", `W/"x", *`)
	f.Add("GET", "/console/%2e%2e/x", `"`)
	f.Fuzz(func(t *testing.T, method, uri, inm string) {
		var ctx fasthttp.RequestCtx
		ctx.Request.Header.SetMethod(method)
		ctx.Request.SetRequestURI(uri)
		ctx.Request.Header.Set("If-None-Match", inm)
		if !Owns(ctx.Path()) {
			return
		}
		Handler(&ctx)
		switch s := ctx.Response.StatusCode(); s {
		case 200, 304, 404, 405:
		default:
			t.Fatalf("%s %q: status %d", method, uri, s)
		}
	})
}

// BenchmarkHandler is what one page load costs the router per file: a map
// lookup and a prepared body (gzip is done once, at start-up).
func BenchmarkHandler(b *testing.B) {
	for _, c := range []struct{ name, uri, inm string }{
		{"page-gzip", "/", ""},
		{"script-gzip", "/console/console.js", ""},
		{"script-304", "/console/console.js", assets["console.js"].etag},
	} {
		b.Run(c.name, func(b *testing.B) {
			var ctx fasthttp.RequestCtx
			b.ReportAllocs()
			for b.Loop() {
				ctx.Request.Reset()
				ctx.Response.Reset()
				ctx.Request.Header.SetMethod("GET")
				ctx.Request.SetRequestURI(c.uri)
				ctx.Request.Header.Set("Accept-Encoding", "gzip")
				if c.inm != "" {
					ctx.Request.Header.Set("If-None-Match", c.inm)
				}
				Handler(&ctx)
			}
		})
	}
}
