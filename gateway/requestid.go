package gateway

import (
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"sync/atomic"

	"github.com/valyala/fasthttp"
)

// Request ids tie one request together across the client, the router's log
// lines and the engine: vLLM takes X-Request-Id as its own request id (its
// answer's id becomes chatcmpl-<id>). A client's id is kept when usable;
// otherwise the router makes one, unique across routers and restarts by a
// random per-process prefix, and sets it on the request it forwards.

var hdrRequestID = []byte("X-Request-Id")

// maxRequestIDLen bounds a client's id: it is logged and echoed per request.
const maxRequestIDLen = 128

var (
	requestIDPrefix = newRequestIDPrefix()
	requestIDs      atomic.Uint64
)

func newRequestIDPrefix() string {
	var b [6]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return "kvm-" + hex.EncodeToString(b[:]) + "-"
}

// requestID appends the request's id to buf: the client's X-Request-Id when
// it is 1–128 visible ASCII characters, else a new one, which replaces the
// client's header so the engine gets the id the router logs.
func requestID(h *fasthttp.RequestHeader, buf []byte) []byte {
	if id := h.PeekBytes(hdrRequestID); usableRequestID(id) {
		return append(buf, id...)
	}
	buf = append(buf, requestIDPrefix...)
	buf = strconv.AppendUint(buf, requestIDs.Add(1), 36)
	h.SetCanonical(hdrRequestID, buf)
	return buf
}

func usableRequestID(id []byte) bool {
	if len(id) == 0 || len(id) > maxRequestIDLen {
		return false
	}
	for _, c := range id {
		if c <= ' ' || c > '~' {
			return false
		}
	}
	return true
}
