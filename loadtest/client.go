// Package loadtest replays seeded workloads through a kvmesh fleet it
// starts itself, one fresh cluster per routing policy, and reports the
// policies side by side (see cmd/loadtest and CONTRACT.md).
package loadtest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
)

// Client sends workload requests as streamed chat completions, and agent
// turns through the Responses API (agent.go), and times them: TTFT at the
// first chunk or event carrying output, E2E at the stream's end.
type Client struct {
	HTTP  *http.Client
	Model string
	// Chat sends agent turns as the chat completions they amount to
	// instead of through the Responses API.
	Chat bool
	// conversations holds each agent conversation's *conversation after
	// its last turn, by name. A turn is only sent after its previous one
	// ended (Replay's After), so each is used by one request at a time.
	conversations sync.Map
}

// NewClient returns a client whose transport keeps enough idle
// connections for an open-loop burst to each target.
func NewClient(model string) *Client {
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	return &Client{HTTP: &http.Client{Transport: tr}, Model: model}
}

type chatBody struct {
	Model         string             `json:"model"`
	Messages      []workload.Message `json:"messages"`
	MaxTokens     int                `json:"max_tokens"`
	Stream        bool               `json:"stream"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	Temperature float64 `json:"temperature"`
}

// chunk is the part of a streamed chat chunk the client reads.
type chunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// Do sends r to base (a router or engine URL) and returns its record;
// Start is left for the caller. It never panics on a bad response: every
// failure is an error string in the record.
func (c *Client) Do(ctx context.Context, base string, r workload.Request) report.Record {
	if r.Agent != nil {
		return c.doAgent(ctx, base, r)
	}
	rec := newRecord(base, r)
	body := chatBody{Model: c.Model, Messages: r.Messages, MaxTokens: r.MaxTokens, Stream: true}
	body.StreamOptions.IncludeUsage = true
	raw, err := json.Marshal(body)
	if err != nil {
		rec.Err = err.Error()
		return rec
	}
	start := time.Now()
	resp := c.post(ctx, base+"/v1/chat/completions", raw, r, &rec)
	if resp == nil {
		return rec
	}
	defer resp.Body.Close()
	readStream(ctx, resp.Body, start, &rec, nil)
	rec.E2E = time.Since(start)
	if rec.PrefillCached >= 0 {
		rec.ActualCached = rec.PrefillCached
	}
	return rec
}

func newRecord(base string, r workload.Request) report.Record {
	return report.Record{Router: base, Key: r.Key, Tenant: r.Tenant, Priority: r.Priority,
		PredictedCached: -1, RouterPromptTokens: -1, PromptTokens: r.PromptTokens, QueueMs: -1, PrefillCached: -1}
}

// post sends a streamed request and reads the router's headers into rec.
// It returns the response when it is a 200 (the caller reads and closes
// its body), nil with rec.Err set otherwise.
func (c *Client) post(ctx context.Context, url string, raw []byte, r workload.Request, rec *report.Record) *http.Response {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(raw))
	if err != nil {
		rec.Err = err.Error()
		return nil
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	if r.Tenant != "" {
		req.Header.Set("Authorization", "Bearer "+workload.TenantKey(r.Tenant))
	}
	if r.Priority != "" {
		req.Header.Set("X-Kvmesh-Priority", r.Priority)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		rec.Err = classify(ctx, err, "connect")
		return nil
	}
	rec.Status = resp.StatusCode
	rec.Replica = resp.Header.Get("X-Kvmesh-Replica")
	rec.Mode = resp.Header.Get("X-Kvmesh-Mode")
	rec.PredictedCached = headerInt(resp.Header, "X-Kvmesh-Cached-Tokens")
	rec.RouterPromptTokens = headerInt(resp.Header, "X-Kvmesh-Prompt-Tokens")
	rec.PrefillCached = headerInt(resp.Header, "X-Kvmesh-Prefill-Cached-Tokens")
	rec.PrefillReplica = resp.Header.Get("X-Kvmesh-Prefill-Replica")
	if v := resp.Header.Get("X-Kvmesh-Queue-Ms"); v != "" {
		if ms, err := strconv.ParseFloat(v, 64); err == nil {
			rec.QueueMs = ms
		}
	}
	rec.RejectReason = resp.Header.Get("X-Kvmesh-Reject-Reason")
	rec.RetryAfter = resp.Header.Get("Retry-After") != ""
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		resp.Body.Close()
		rec.Err = fmt.Sprintf("http %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
		return nil
	}
	return resp
}

// headerInt reads an integer header, -1 when absent or malformed.
func headerInt(h http.Header, name string) int {
	if n, err := strconv.Atoi(h.Get(name)); err == nil {
		return n
	}
	return -1
}

// classify names a transport failure, telling our own deadline apart.
func classify(ctx context.Context, err error, phase string) string {
	if ctx.Err() != nil {
		return phase + ": " + context.Cause(ctx).Error()
	}
	return phase + ": " + err.Error()
}

// readStream reads an OpenAI chat SSE stream into rec: TTFT at the first
// chunk with content, usage from the chunk that carries it, and an error
// for a broken, erroring or content-free stream; the content goes to text
// when it is not nil. Any byte sequence is handled without panicking.
func readStream(ctx context.Context, body io.Reader, start time.Time, rec *report.Record, text *strings.Builder) {
	contentChunks := 0
	sawUsage, done := false, false
	var lastChunk time.Time
	br := bufio.NewReaderSize(body, 64<<10)
	for !done {
		line, err := br.ReadSlice('\n')
		if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
			if errors.Is(err, bufio.ErrBufferFull) {
				rec.Err = "stream: SSE line over 64 KiB"
			} else if errors.Is(err, io.EOF) {
				rec.Err = "stream ended without [DONE]"
			} else {
				rec.Err = classify(ctx, err, "stream")
			}
			break
		}
		done = errors.Is(err, io.EOF)
		data, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if bytes.Equal(data, []byte("[DONE]")) {
			done = true
			break
		}
		// After the first token, only chunks with usage or an error need
		// decoding; counting the rest keeps the client cheap.
		if rec.TTFT > 0 && text == nil && !bytes.Contains(data, []byte(`"prompt_tokens"`)) && !bytes.Contains(data, []byte(`"error"`)) {
			contentChunks++
			now := time.Now()
			rec.Gaps = append(rec.Gaps, now.Sub(lastChunk))
			lastChunk = now
			continue
		}
		var ch chunk
		if err := json.Unmarshal(data, &ch); err != nil {
			rec.Err = "stream: bad chunk: " + err.Error()
			break
		}
		if ch.Error != nil {
			rec.Err = "stream error: " + ch.Error.Message
			break
		}
		for _, c := range ch.Choices {
			if c.Delta.Content != "" {
				if text != nil {
					text.WriteString(c.Delta.Content)
				}
				if rec.TTFT == 0 {
					rec.TTFT = max(time.Since(start), time.Nanosecond)
					lastChunk = time.Now()
				} else {
					now := time.Now()
					rec.Gaps = append(rec.Gaps, now.Sub(lastChunk))
					lastChunk = now
				}
				contentChunks++
				break
			}
		}
		if ch.Usage != nil && ch.Usage.PromptTokens > 0 {
			sawUsage = true
			rec.PromptTokens = ch.Usage.PromptTokens
			rec.OutputTokens = ch.Usage.CompletionTokens
			if d := ch.Usage.PromptTokensDetails; d != nil {
				rec.ActualCached = d.CachedTokens
			}
		}
	}
	if rec.Err == "" && rec.TTFT == 0 {
		rec.Err = "stream had no content"
	}
	if rec.Err == "" && !sawUsage {
		rec.OutputTokens = contentChunks
	}
}
