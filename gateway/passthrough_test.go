package gateway

import (
	"bytes"
	"mime/multipart"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// TestOtherEndpointsPassThroughByModel: embeddings, audio and vLLM's
// scoring endpoints reach a replica serving the request's model, body,
// query and content type untouched, as does a Responses request (routed as
// a chat); adapter loading and unknown models do not.
func TestOtherEndpointsPassThroughByModel(t *testing.T) {
	type seen struct{ uri, ctype, body string }
	got := make(chan seen, 16)
	engine := func(name string) string {
		// DisablePreParseMultipartForm: else fasthttp rebuilds the body it shows.
		return listen(t, &fasthttp.Server{DisablePreParseMultipartForm: true, Handler: func(ctx *fasthttp.RequestCtx) {
			got <- seen{string(ctx.RequestURI()), string(ctx.Request.Header.ContentType()), string(ctx.PostBody())}
			ctx.SetContentType("application/json")
			ctx.SetBodyString(`{"object":"list","served_by":"` + name + `","usage":{"prompt_tokens":5}}`)
		}})
	}
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("emb", engine("emb"), []string{"embedder"})
	r.table.AddStatic("chat", engine("chat"), []string{testModel})

	var form bytes.Buffer
	mw := multipart.NewWriter(&form)
	fw, _ := mw.CreateFormFile("file", "a.wav")
	_, _ = fw.Write(bytes.Repeat([]byte{0, 1, 2, 3}, 1000))
	_ = mw.WriteField("model", "embedder")
	_ = mw.Close()

	for _, c := range []struct {
		path, ctype, body, replica string
	}{
		{"/v1/embeddings", "application/json", `{"model":"embedder","input":["a","b"],"encoding_format":"float"}`, "emb"},
		{"/v1/responses?trace=1", "application/json", `{"model":"sim","input":"Hi","max_output_tokens":4}`, "chat"},
		{"/rerank", "application/json", `{"model":"embedder","query":"q","documents":["d"]}`, "emb"},
		{"/v1/audio/transcriptions", mw.FormDataContentType(), form.String(), "emb"},
	} {
		res := r.post(t, c.path, c.body, "Content-Type", c.ctype)
		if res.status != 200 || res.header["x-kvmesh-replica"] != c.replica || res.header["x-kvmesh-mode"] != "static" ||
			!strings.Contains(res.body, `"served_by":"`+c.replica+`"`) {
			t.Fatalf("%s: %d %v %s", c.path, res.status, res.header, res.body)
		}
		select {
		case s := <-got:
			if s.uri != c.path || s.ctype != c.ctype || s.body != c.body {
				t.Fatalf("%s: the engine got %q %q %d bytes (sent %d), want the request untouched", c.path, s.uri, s.ctype, len(s.body), len(c.body))
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: no request reached an engine", c.path)
		}
	}
	for _, c := range []struct {
		path, body string
		status     int
	}{
		{"/v1/embeddings", `{"model":"nobody","input":"a"}`, 404},
		{"/v1/embeddings", `{"model":`, 400},
		{"/v1/load_lora_adapter", `{"lora_name":"x","lora_path":"/x"}`, 404},
	} {
		if res := r.post(t, c.path, c.body); res.status != c.status || !strings.Contains(res.body, `"error"`) {
			t.Errorf("%s %s: %d %s, want %d", c.path, c.body, res.status, res.body, c.status)
		}
	}
	if len(got) > 0 {
		t.Errorf("a rejected request reached an engine: %+v", <-got)
	}
}
