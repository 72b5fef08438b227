package enginesim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"reflect"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/hangup"
	"github.com/kvmesh/kvmesh/tokenize"
)

// apiRequest is the union of the completion, chat completion and tokenize
// request fields enginesim reads; the rest are accepted and ignored, as a
// sampling-free engine may.
type apiRequest struct {
	Model                *string         `json:"model"`
	Prompt               json.RawMessage `json:"prompt"`
	Messages             json.RawMessage `json:"messages"`
	MaxTokens            *int            `json:"max_tokens"`
	MaxCompletionTokens  *int            `json:"max_completion_tokens"`
	Stream               *bool           `json:"stream"`
	StreamOptions        *streamOptions  `json:"stream_options"`
	N                    *int            `json:"n"`
	AddSpecialTokens     *bool           `json:"add_special_tokens"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage *bool           `json:"continue_final_message"`
	Tools                json.RawMessage `json:"tools"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
	// Priority is vLLM's request priority: lower is served earlier, under
	// --scheduling-policy priority only.
	Priority *int `json:"priority"`
	// KVTransferParams are vLLM's disaggregation parameters
	// (kv_transfer_params): see disagg.go.
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

type streamOptions struct {
	IncludeUsage *bool
	set          map[string]json.RawMessage // every key given
}

func (o *streamOptions) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, &o.set); err != nil {
		return err
	}
	if v, ok := o.set["include_usage"]; ok {
		o.IncludeUsage = new(bool) // an explicit null is None there: false
		if string(v) != "null" {
			return json.Unmarshal(v, o.IncludeUsage)
		}
	}
	return nil
}

// requestError is a client error with its HTTP status and vLLM type.
type requestError struct {
	code int
	typ  string
	msg  string
}

func (e *requestError) Error() string { return e.msg }

// jsonErrorText says what is wrong with a request field in the client's
// terms: encoding/json names Go types ("Go struct field apiRequest.max_tokens
// of type int"), which mean nothing to a client.
func jsonErrorText(err error) string {
	var te *json.UnmarshalTypeError
	switch {
	case !errors.As(err, &te):
		return err.Error()
	case te.Field == "":
		return fmt.Sprintf("expected %s, not %s", jsonKind(te.Type), te.Value)
	}
	return fmt.Sprintf("%s must be %s, not %s", te.Field, jsonKind(te.Type), te.Value)
}

// jsonKind names the JSON value a Go type is decoded from.
func jsonKind(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Slice, reflect.Array:
		return "a list"
	case reflect.Map, reflect.Struct:
		return "an object"
	}
	return "a different JSON value"
}

func invalid(format string, args ...any) *requestError {
	return &requestError{code: fasthttp.StatusBadRequest, typ: "BadRequestError", msg: fmt.Sprintf(format, args...)}
}

func writeRequestError(ctx *fasthttp.RequestCtx, e *requestError) {
	writeError(ctx, e.code, e.typ, e.msg)
}

func present(raw json.RawMessage) bool {
	return len(raw) > 0 && !bytes.Equal(raw, []byte("null"))
}

func boolOr(p *bool, def bool) bool {
	if p == nil {
		return def
	}
	return *p
}

// parseRequest decodes a request body and checks what every endpoint
// shares: valid UTF-8, a JSON object, the served model name.
func (s *Server) parseRequest(body []byte) (*apiRequest, *requestError) {
	if !utf8.Valid(body) {
		return nil, invalid("request body is not valid UTF-8")
	}
	body = bytes.TrimSpace(body)
	if len(body) == 0 || body[0] != '{' {
		return nil, invalid("request body must be a JSON object")
	}
	var r apiRequest
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, invalid("invalid request: %s", jsonErrorText(err))
	}
	if r.Model != nil && *r.Model != s.cfg.Model {
		return nil, &requestError{code: fasthttp.StatusNotFound, typ: "NotFoundError", msg: fmt.Sprintf("The model `%s` does not exist.", *r.Model)}
	}
	return &r, nil
}

// promptTokens tokenizes the request as vLLM would: chat messages through
// the chat template (no special tokens unless asked), a completion prompt
// with special tokens unless asked not to.
func (s *Server) promptTokens(r *apiRequest, chat bool) ([]uint32, *requestError) {
	if chat {
		if !present(r.Messages) {
			return nil, invalid("field required: messages")
		}
		if r.Messages[0] != '[' {
			return nil, invalid("messages must be a list")
		}
		var msgs []json.RawMessage
		if err := json.Unmarshal(r.Messages, &msgs); err != nil {
			return nil, invalid("messages: %v", err)
		}
		for i, m := range msgs {
			if m = bytes.TrimSpace(m); len(m) == 0 || m[0] != '{' {
				return nil, invalid("messages[%d] must be an object", i)
			}
		}
		addGen := boolOr(r.AddGenerationPrompt, true)
		cont := boolOr(r.ContinueFinalMessage, false)
		if addGen && cont {
			return nil, invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
		}
		c := tokenize.Chat{Messages: r.Messages, AddGenerationPrompt: addGen, ContinueFinalMessage: cont, AddSpecialTokens: boolOr(r.AddSpecialTokens, false)}
		if present(r.Tools) {
			c.Tools = r.Tools
		}
		if present(r.ChatTemplateKwargs) {
			c.TemplateKwargs = r.ChatTemplateKwargs
		}
		_, ids, err := s.cfg.Tokenizer.EncodeChat(c)
		if err != nil {
			return nil, invalid("%v", err)
		}
		return ids, nil
	}
	if !present(r.Prompt) {
		return nil, invalid("field required: prompt")
	}
	addSpecial := boolOr(r.AddSpecialTokens, true)
	raw := r.Prompt
	if raw[0] == '[' {
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return nil, invalid("prompt: %v", err)
		}
		if len(items) == 0 {
			return nil, invalid("prompt: empty list")
		}
		if item := bytes.TrimSpace(items[0]); len(item) > 0 && (item[0] == '"' || item[0] == '[') {
			if len(items) > 1 {
				return nil, invalid("prompt: enginesim serves one prompt per request, got %d", len(items))
			}
			raw = item
		}
	}
	switch raw[0] {
	case '"':
		var text string
		if err := json.Unmarshal(raw, &text); err != nil {
			return nil, invalid("prompt: %v", err)
		}
		ids, err := s.cfg.Tokenizer.Encode(text, addSpecial)
		if err != nil {
			return nil, invalid("%v", err)
		}
		return ids, nil
	case '[':
		var ids []uint32
		if err := json.Unmarshal(raw, &ids); err != nil {
			return nil, invalid("prompt: token ids must be integers in [0, 2^32): %s", jsonErrorText(err))
		}
		// encoding/json leaves a null element at 0; vLLM's validation
		// refuses it. In a list that decoded as numbers, "null" can only
		// be such an element.
		if bytes.Contains(raw, []byte("null")) {
			return nil, invalid("prompt: token ids must be integers, got null")
		}
		return ids, nil
	}
	return nil, invalid("prompt must be a string, a list of token ids, or a list of one of those")
}

// maxTokens resolves max_tokens (max_completion_tokens for chat) against
// the model length the way vLLM's validation words it.
func (s *Server) maxTokens(r *apiRequest, chat bool, promptLen int) (int, *requestError) {
	limit := s.cfg.Engine.MaxModelLen
	if promptLen == 0 {
		return 0, invalid("The prompt cannot be empty.")
	}
	if promptLen >= limit {
		return 0, invalid("This model's maximum context length is %d tokens. However, your request has %d input tokens. Please reduce the length of the input messages.", limit, promptLen)
	}
	p := r.MaxTokens
	if chat && r.MaxCompletionTokens != nil {
		p = r.MaxCompletionTokens
	}
	if p == nil {
		return min(DefaultMaxTokens, limit-promptLen), nil
	}
	if *p < 1 {
		return 0, invalid("max_tokens must be at least 1, got %d.", *p)
	}
	// *p > limit-promptLen, not promptLen+*p > limit: clients send
	// sys.maxsize for "no limit", and the sum would wrap negative.
	if *p > limit-promptLen {
		return 0, invalid("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.", limit, uint64(promptLen)+uint64(*p), promptLen, *p)
	}
	return *p, nil
}

func (s *Server) tokenizeEndpoint(ctx *fasthttp.RequestCtx) {
	r, rerr := s.parseRequest(ctx.PostBody())
	if rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	chat := present(r.Messages)
	if !chat && present(r.Prompt) && r.Prompt[0] != '"' {
		badRequest(ctx, "prompt must be a string")
		return
	}
	ids, rerr := s.promptTokens(r, chat)
	if rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	b := make([]byte, 0, 64+len(ids)*7)
	b = append(b, `{"count":`...)
	b = strconv.AppendInt(b, int64(len(ids)), 10)
	b = append(b, `,"max_model_len":`...)
	b = strconv.AppendInt(b, int64(s.cfg.Engine.MaxModelLen), 10)
	b = append(b, `,"tokens":[`...)
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(id), 10)
	}
	b = append(b, `],"token_strs":null}`...)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// generate serves /v1/completions and /v1/chat/completions.
func (s *Server) generate(ctx *fasthttp.RequestCtx, chat bool) {
	r, rerr := s.parseRequest(ctx.PostBody())
	if rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	if r.N != nil && *r.N != 1 {
		badRequest(ctx, "enginesim generates one choice per request (n must be 1)")
		return
	}
	stream := boolOr(r.Stream, false)
	// vLLM tests the dict's truth: {} passes without a stream.
	if r.StreamOptions != nil && len(r.StreamOptions.set) > 0 && !stream {
		badRequest(ctx, "Stream options can only be defined when `stream=True`.")
		return
	}
	ids, rerr := s.promptTokens(r, chat)
	if rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	maxTokens, rerr := s.maxTokens(r, chat, len(ids))
	if rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	priority := 0
	if r.Priority != nil {
		priority = *r.Priority
	}
	if priority != 0 && !s.cfg.Engine.PriorityScheduling {
		badRequest(ctx, fmt.Sprintf("Got priority %d but Priority scheduling is not enabled.", priority))
		return
	}
	params, rerr := parseKVTransferParams(r.KVTransferParams)
	if rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	rs := &response{s: s, chat: chat}
	// vLLM's StreamOptions.include_usage defaults to true (OpenAI's to
	// false): stream_options: {} asks for the usage chunk there.
	rs.includeUsage = stream && r.StreamOptions != nil && boolOr(r.StreamOptions.IncludeUsage, true)
	s.run(ctx, rs, engine.Request{Prompt: ids, MaxTokens: maxTokens, Priority: priority}, params, stream)
}

// run submits req to a rank's engine, with its kv_transfer_params (nil:
// none), and answers with rs's rendering of its output, whole or as a
// stream.
func (s *Server) run(ctx *fasthttp.RequestCtx, rs *response, req engine.Request, params kvTransferParams, stream bool) {
	rk, rerr := s.pickRank(ctx)
	if rerr != nil {
		writeRequestError(ctx, rerr)
		return
	}
	remoteDecode, remote, failed := s.kvTransfer(rk, params)
	if failed {
		writeGenerationError(ctx, stream)
		return
	}
	id := s.nextID.Add(1)
	req.ID, req.OutputSeed = id, outputSeed(req.Prompt)
	req.RemoteDecode, req.RemotePrefill = remoteDecode, remote != nil
	c := newCall(req)
	c.stream = stream
	c.loop = rk.loop
	if remote != nil {
		c.remote, c.received = remote, make(chan struct{})
	}
	select {
	case rk.loop.submit <- c:
	case <-s.stopped:
		s.doneWithRemote(c)
		writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", errShutdown.Error())
		return
	}
	rs.id, rs.rank, rs.created, rs.promptLen = id, rk.loop.rank, time.Now().Unix(), len(req.Prompt)
	rs.requestID = string(ctx.Request.Header.Peek("X-Request-Id"))
	if !stream {
		s.respond(ctx, c, rs)
		return
	}
	ctx.SetContentType("text/event-stream; charset=utf-8")
	// The writer runs after the handler returned, ctx no longer its to use;
	// the connection stays open until the writer is done.
	conn := ctx.Conn()
	ctx.SetBodyStreamWriter(func(w *bufio.Writer) { s.stream(w, conn, c, rs) })
}

// abort tells the engine to drop c, whose client is gone.
func (s *Server) abort(c *call) {
	select {
	case c.loop.abort <- c.req.ID:
	case <-s.stopped:
	}
}

// clientPoll is how often a request waiting on the engine checks that its
// client is still there: a client gone is noticed (and its request aborted,
// as vLLM does) within this, at one poll(2) per waiting request per tick.
const clientPoll = 100 * time.Millisecond

// await blocks until c has news or the engine stopped (true), or until its
// client left (false, c aborted). A non-streamed answer writes nothing until
// its end and a stream nothing while queued or in prefill, and fasthttp
// tells of a client gone only at a failed write: the socket is looked at.
func (s *Server) await(c *call, conn net.Conn, poll *time.Ticker) bool {
	received := c.received
	if c.notified {
		received = nil
	}
	for {
		select {
		case <-received:
			s.doneWithRemote(c)
			received = nil
		case <-c.notify:
			return true
		case <-s.stopped:
			return true
		case <-poll.C:
			if hangup.Gone(conn) {
				s.abort(c)
				return false
			}
		}
	}
}

// doneWithRemote tells a remote prefill's engine, once, that c no longer
// needs its blocks: the KV is in, or c ended without it.
func (s *Server) doneWithRemote(c *call) {
	if c.remote != nil && !c.notified {
		c.notified = true
		s.notifyRemote(c.remote)
	}
}

func (s *Server) respond(ctx *fasthttp.RequestCtx, c *call, rs *response) {
	defer s.doneWithRemote(c)
	var toks []uint32
	poll := time.NewTicker(clientPoll)
	defer poll.Stop()
	for {
		if !s.await(c, ctx.Conn(), poll) {
			return
		}
		var done bool
		var err error
		toks, rs.cached, done, err = c.take(toks[:0], 0)
		if err != nil {
			writeError(ctx, fasthttp.StatusInternalServerError, "InternalServerError", err.Error())
			return
		}
		if done {
			break
		}
		select {
		case <-s.stopped:
			writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", errShutdown.Error())
			return
		default:
		}
	}
	if held := c.heldBlocks(); held != nil {
		// Without a configured side channel, the address the prefill
		// request reached is the one a decode engine can reach too.
		side := s.cfg.SideChannel
		if side == "" {
			side = ctx.LocalAddr().String()
		}
		rs.kvParams = appendKVTransferParams(make([]byte, 0, 256+len(held)*6), side, s.engineID(rs.rank), s.remoteRequestID(rs.id), held)
	}
	ctx.SetContentType("application/json")
	ctx.SetBody(rs.full(make([]byte, 0, 512+len(toks)*8+len(rs.kvParams)), toks))
}

func (s *Server) stream(w *bufio.Writer, conn net.Conn, c *call, rs *response) {
	defer s.doneWithRemote(c)
	var (
		toks []uint32
		buf  []byte
		sent int
	)
	poll := time.NewTicker(clientPoll)
	defer poll.Stop()
	if pre := rs.prelude(nil); len(pre) > 0 {
		if _, err := w.Write(pre); err != nil || w.Flush() != nil {
			s.abort(c)
			return
		}
	}
	for {
		if !s.await(c, conn, poll) {
			return
		}
		var done bool
		var err error
		toks, rs.cached, done, err = c.take(toks[:0], sent)
		if err == nil && !done && len(toks) == 0 {
			select {
			case <-s.stopped:
				// Submitted as the loop stopped: nothing will come, and
				// wait no longer waits.
				err = errShutdown
			default:
			}
		}
		if err != nil {
			buf = append(buf[:0], `data: {"error":{"message":`...)
			buf = appendJSONString(buf, err.Error())
			buf = append(buf, `,"type":"InternalServerError","param":null,"code":500}}`+"\n\ndata: [DONE]\n\n"...)
			_, _ = w.Write(buf)
			_ = w.Flush()
			return
		}
		buf = buf[:0]
		if sent == 0 && len(toks) > 0 {
			buf = rs.opening(buf)
		}
		for i, t := range toks {
			buf = rs.chunk(buf, s.vocabText[t], false, done && i == len(toks)-1)
		}
		if done && len(toks) == 0 {
			buf = rs.chunk(buf, "", false, true)
		}
		sent += len(toks)
		if done {
			rs.completion = sent
			buf = rs.closing(buf)
		}
		if len(buf) > 0 {
			if _, err := w.Write(buf); err != nil {
				s.abort(c)
				return
			}
			// A failed flush is the only sign of a client gone.
			if err := w.Flush(); err != nil {
				s.abort(c)
				return
			}
		}
		if done {
			return
		}
	}
}

// response renders one request's OpenAI JSON.
type response struct {
	s            *Server
	chat         bool
	agent        *agentAnswer // a Responses or Messages request's; nil for chat and completions
	id           uint64
	rank         int    // the data-parallel rank serving it
	requestID    string // the client's X-Request-Id: vLLM makes it the answer's id
	created      int64
	promptLen    int
	cached       int
	completion   int
	includeUsage bool
	// kvParams are the kv_transfer_params of a prefill held for a remote
	// decode, nil otherwise (vLLM's null, left out).
	kvParams []byte
}

func (r *response) head(b []byte, object string) []byte {
	b = append(b, `{"id":"`...)
	if r.chat {
		b = append(b, "chatcmpl-"...)
	} else {
		b = append(b, "cmpl-"...)
	}
	if r.requestID != "" {
		b = appendJSONStringBody(b, r.requestID)
	} else {
		b = append(b, r.s.idPrefix...)
		b = strconv.AppendUint(b, r.id, 16)
	}
	b = append(b, `","object":"`...)
	b = append(b, object...)
	b = append(b, `","created":`...)
	b = strconv.AppendInt(b, r.created, 10)
	b = append(b, `,"model":`...)
	return appendJSONString(b, r.s.cfg.Model)
}

func (r *response) usage(b []byte) []byte {
	b = append(b, `"usage":{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(r.promptLen), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(r.promptLen+r.completion), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(r.completion), 10)
	b = append(b, `,"prompt_tokens_details":{"cached_tokens":`...)
	b = strconv.AppendInt(b, int64(r.cached), 10)
	return append(b, `}}`...)
}

// opening is what a stream sends with its first tokens: the assistant
// role for a chat.
func (r *response) opening(b []byte) []byte {
	switch {
	case r.agent != nil:
		return r.agentOpening(b)
	case r.chat:
		return r.chunk(b, "", true, false)
	}
	return b
}

// closing ends a stream: the usage chunk when asked for, then [DONE].
func (r *response) closing(b []byte) []byte {
	if r.agent != nil {
		return r.agentClosing(b)
	}
	if r.includeUsage {
		b = r.usageChunk(b)
	}
	return append(b, "data: [DONE]\n\n"...)
}

// prelude is what a stream sends before the engine has produced anything.
func (r *response) prelude(b []byte) []byte {
	if r.agent != nil {
		return r.agentPrelude(b)
	}
	return b
}

func (r *response) full(b []byte, toks []uint32) []byte {
	r.completion = len(toks)
	if r.agent != nil {
		return r.agentFull(b, toks)
	}
	var text []byte
	for _, t := range toks {
		text = append(text, r.s.vocabText[t]...)
	}
	if r.chat {
		b = r.head(b, "chat.completion")
		b = append(b, `,"choices":[{"index":0,"message":{"role":"assistant","content":`...)
		b = appendJSONString(b, string(text))
		b = append(b, `,"refusal":null,"annotations":null,"audio":null,"function_call":null,"tool_calls":[],"reasoning_content":null},"logprobs":null,"finish_reason":"length","stop_reason":null}],`...)
	} else {
		b = r.head(b, "text_completion")
		b = append(b, `,"choices":[{"index":0,"text":`...)
		b = appendJSONString(b, string(text))
		b = append(b, `,"logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null}],`...)
	}
	b = r.usage(b)
	if r.kvParams != nil {
		// vLLM's CompletionResponse and ChatCompletionResponse end with
		// kv_transfer_params.
		b = append(b, `,"kv_transfer_params":`...)
		b = append(b, r.kvParams...)
	}
	return append(b, '}')
}

// chunk appends one SSE event: the assistant role (chat only), or a piece
// of text, the last one carrying the finish reason.
func (r *response) chunk(b []byte, text string, role, last bool) []byte {
	if r.agent != nil {
		return r.agentPiece(b, text, last)
	}
	b = append(b, "data: "...)
	finish := "null"
	if last {
		finish = `"length"`
	}
	if r.chat {
		b = r.head(b, "chat.completion.chunk")
		b = append(b, `,"choices":[{"index":0,"delta":{`...)
		if role {
			b = append(b, `"role":"assistant","content":""`...)
		} else {
			b = append(b, `"content":`...)
			b = appendJSONString(b, text)
		}
		b = append(b, `},"logprobs":null,"finish_reason":`...)
		b = append(b, finish...)
		b = append(b, `}]}`...)
	} else {
		b = r.head(b, "text_completion")
		b = append(b, `,"choices":[{"index":0,"text":`...)
		b = appendJSONString(b, text)
		b = append(b, `,"logprobs":null,"finish_reason":`...)
		b = append(b, finish...)
		b = append(b, `,"stop_reason":null}]}`...)
	}
	return append(b, "\n\n"...)
}

func (r *response) usageChunk(b []byte) []byte {
	b = append(b, "data: "...)
	if r.chat {
		b = r.head(b, "chat.completion.chunk")
	} else {
		b = r.head(b, "text_completion")
	}
	b = append(b, `,"choices":[],`...)
	b = r.usage(b)
	return append(b, "}\n\n"...)
}

// outputSeed makes the output a function of the prompt: the same request
// gets the same answer.
func outputSeed(ids []uint32) uint64 {
	h := fnv.New64a()
	var buf [4]byte
	for _, id := range ids {
		buf[0], buf[1], buf[2], buf[3] = byte(id), byte(id>>8), byte(id>>16), byte(id>>24)
		_, _ = h.Write(buf[:])
	}
	return h.Sum64()
}

// outputWords are what the engine "generates".
var outputWords = []string{
	"the", "cache", "block", "token", "router", "prefix", "engine", "replica",
	"stream", "batch", "model", "queue", "filter", "gossip", "sidecar", "event",
	"latency", "prompt", "decode", "prefill", "memory", "vector", "layer", "shard",
	"signal", "packet", "kernel", "thread", "record", "buffer", "window", "cluster",
	"and", "of", "to", "in", "is", "it", "on", "with",
	"fast", "warm", "cold", "hot", "near", "far", "new", "old",
}

// outputVocab picks, among outputWords, those the tokenizer encodes (with a
// leading space) as one token: output tokens then read back as text and
// re-tokenize to the same ids.
func outputVocab(tok tokenize.Model) ([]uint32, map[uint32]string) {
	var ids []uint32
	text := map[uint32]string{}
	for _, w := range outputWords {
		enc, err := tok.Encode(" "+w, false)
		if err != nil || len(enc) != 1 {
			continue
		}
		if _, dup := text[enc[0]]; dup {
			continue
		}
		ids = append(ids, enc[0])
		text[enc[0]] = " " + w
	}
	return ids, text
}
