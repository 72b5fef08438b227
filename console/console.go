// Package console is the operator's status page that every router serves at
// "/": one HTML page, a stylesheet and a script, embedded in the binary, with
// no build step and no outside assets, so it works on an offline cluster.
//
// The page itself reads the router's public JSON and metrics
// (/admin/replicas, /metrics) every two seconds and calls
// /admin/routes/clear; this package only serves the files. Each file is
// prepared once at start-up (ETag, gzip: 12 KB for the whole page), so
// serving one costs a few µs and no allocation (BenchmarkHandler: 4–8 µs
// on the 2-core dev machine, including the test's request set-up).
package console

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"io/fs"
	"path"
	"strings"

	"github.com/valyala/fasthttp"
)

// Prefix is where the page's assets live; the page is at "/".
const Prefix = "/console/"

//go:embed static
var static embed.FS

// securityPolicy allows only the router's own origin: no inline script, no
// remote fonts or CDNs, no framing.
const securityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// contentTypes is fixed here rather than read from the host's mime tables,
// which differ between machines.
var contentTypes = map[string]string{
	".html": "text/html; charset=utf-8",
	".css":  "text/css; charset=utf-8",
	".js":   "text/javascript; charset=utf-8",
	".svg":  "image/svg+xml",
}

type asset struct {
	body, gzipped []byte
	contentType   string
	etag          string
}

var assets = mustLoad()

// mustLoad prepares every embedded file; the files are compiled in, so a
// failure is a build defect, not a runtime condition.
func mustLoad() map[string]*asset {
	out := map[string]*asset{}
	err := fs.WalkDir(static, "static", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		body, err := static.ReadFile(p)
		if err != nil {
			return err
		}
		sum := sha256.Sum256(body)
		a := &asset{body: body, etag: `"` + hex.EncodeToString(sum[:8]) + `"`}
		a.contentType = contentTypes[path.Ext(p)]
		if a.contentType == "" {
			return fmt.Errorf("%s: no content type for its extension", p)
		}
		var buf bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
		_, _ = zw.Write(body)
		_ = zw.Close()
		if buf.Len() < len(body) {
			a.gzipped = buf.Bytes()
		}
		out[strings.TrimPrefix(p, "static/")] = a
		return nil
	})
	if err != nil {
		panic("console: embedded assets: " + err.Error())
	}
	return out
}

// Owns reports whether the console answers path: "/" and Prefix's files.
func Owns(path []byte) bool {
	return string(path) == "/" || bytes.HasPrefix(path, []byte(Prefix))
}

// Handler serves the page at "/" and its assets under Prefix, to GET and
// HEAD, with an ETag (revalidated on every load, so a new router binary's
// page shows at once) and gzip when the client accepts it.
func Handler(ctx *fasthttp.RequestCtx) {
	if !ctx.IsGet() && !ctx.IsHead() {
		ctx.Response.Header.Set(fasthttp.HeaderAllow, "GET, HEAD")
		plain(ctx, fasthttp.StatusMethodNotAllowed, "method not allowed\n")
		return
	}
	name := "index.html"
	if p := string(ctx.Path()); p != "/" {
		name = strings.TrimPrefix(p, Prefix)
	}
	a := assets[name]
	if a == nil || name == "index.html" && string(ctx.Path()) != "/" {
		plain(ctx, fasthttp.StatusNotFound, "not found\n")
		return
	}
	h := &ctx.Response.Header
	h.Set(fasthttp.HeaderCacheControl, "no-cache")
	h.Set(fasthttp.HeaderETag, a.etag)
	h.Set(fasthttp.HeaderVary, "Accept-Encoding")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	if name == "index.html" {
		h.Set("Content-Security-Policy", securityPolicy)
	}
	if match := ctx.Request.Header.Peek(fasthttp.HeaderIfNoneMatch); len(match) > 0 && etagMatches(match, a.etag) {
		ctx.SetStatusCode(fasthttp.StatusNotModified)
		return
	}
	h.SetContentType(a.contentType)
	body := a.body
	if a.gzipped != nil && ctx.Request.Header.HasAcceptEncoding("gzip") {
		h.Set(fasthttp.HeaderContentEncoding, "gzip")
		body = a.gzipped
	}
	if ctx.IsHead() {
		h.SetContentLength(len(body))
		return
	}
	ctx.SetBody(body)
}

// etagMatches reads an If-None-Match list ("*", or comma-separated tags,
// weak or strong: a GET compares weakly).
func etagMatches(header []byte, etag string) bool {
	for _, t := range strings.Split(string(header), ",") {
		t = strings.TrimPrefix(strings.TrimSpace(t), "W/")
		if t == "*" || t == etag {
			return true
		}
	}
	return false
}

func plain(ctx *fasthttp.RequestCtx, status int, msg string) {
	ctx.SetStatusCode(status)
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBodyString(msg)
}
