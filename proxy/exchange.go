package proxy

import (
	"bytes"
	"time"

	"github.com/valyala/fasthttp"
)

// Answer is an upstream's whole answer to a request the router makes for
// itself (Exchange), which the client never sees.
type Answer struct {
	// Status is the HTTP status; Body the answer, read whole.
	Status int
	Body   []byte
	// PromptTokens and CachedTokens come from the answer's usage; -1
	// when it carried none.
	PromptTokens, CachedTokens int
	// Elapsed runs from dispatch to the end of the answer.
	Elapsed time.Duration
}

// Exchange sends req to up, not streamed, and reads the answer whole (the
// upstream's buffering limit bounds it; its first-byte timeout the whole
// wait): a step of a request the router takes itself, such as the prefill
// of a disaggregated one. req's headers are forwarded as Forward forwards
// them, and its Abort ends the exchange. err is a transport or timeout
// error, with no answer.
func (f *Forwarder) Exchange(up *Upstream, req *Request) (Answer, error) {
	start := time.Now()
	r := *req
	r.Stream = false
	resp, err := f.dispatch(up, &r, r.Body)
	if err != nil {
		return Answer{PromptTokens: -1, CachedTokens: -1, Elapsed: time.Since(start)}, err
	}
	defer fasthttp.ReleaseResponse(resp)
	a := Answer{Status: resp.StatusCode(), Body: bytes.Clone(resp.Body()), Elapsed: time.Since(start)}
	u := usageFromBody(a.Body)
	a.PromptTokens, a.CachedTokens = u.Prompt, u.Cached
	return a, nil
}
