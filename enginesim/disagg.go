package enginesim

// Prefill/decode disaggregation, as vLLM's NixlConnector and its proxies
// do it (read at vLLM main 002a1057, NIXL_CONNECTOR_VERSION 2:
// vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py, and the
// proxy tests/v1/kv_connector/nixl_integration/toy_proxy_server.py at
// e0099301):
//
//  1. The proxy sends the client's request to a prefill engine with
//     "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill":
//     false, "remote_engine_id": null, ...}, max_tokens 1, no stream. The
//     engine computes the prompt and, finishing at its length, keeps the
//     request's blocks (request_finished: delay_free_blocks) for
//     VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s), answering with
//     kv_transfer_params naming them: do_remote_prefill true,
//     remote_block_ids, remote_engine_id, remote_request_id, remote_host,
//     remote_port, tp_size.
//  2. The proxy sends the client's request with those parameters to a
//     decode engine, which reads the blocks its own cache lacks from the
//     prefill engine, notifies it (the prefill engine frees them then) and
//     decodes.
//
// vLLM's decode engine reads the blocks over NIXL after a handshake on the
// prefill engine's side channel (remote_host, remote_port: its
// VLLM_NIXL_SIDE_CHANNEL_PORT plus its data-parallel rank). enginesim has no
// KV to move: its side channel is its HTTP server (remote_port is the
// HTTP port for every rank, remote_engine_id telling ranks apart, suffixed
// _dpR as vLLM suffixes each rank's engine_id). The decode engine's read is
// a POST of the parameters to readPath, which answers whether the blocks
// are still held, before the transfer is charged; once the transfer is
// done (the request's first token) or the request ends without it, a POST
// to notifyPath frees them, as NIXL's notification does. Until then the
// blocks stay held, so another decode engine can still read them with the
// same parameters if the first one fails.
//
// What vLLM does with parameters it cannot use, and enginesim with it:
//   - kv_transfer_params not an object: the request's validation refuses it
//     (400).
//   - do_remote_prefill without remote_block_ids, or without one of
//     remote_engine_id, remote_request_id, remote_host, remote_port: vLLM
//     logs "Got invalid KVTransferParams ... will not utilize KVTransfer";
//     enginesim prefills locally.
//   - Blocks that expired or an unreachable prefill engine: vLLM's read
//     fails (or, on blocks already freed, reads whatever they hold while the
//     prefill engine logs "Potentially invalid KV blocks ... may have
//     expired"). Its kv_load_failure_policy decides: "fail", the default
//     (vllm/config/kv_transfer.py), finishes the request with finish reason
//     error, which the API server answers as a 500 "Internal server error"
//     (GenerationError); "recompute" computes the prompt locally. enginesim
//     does the same in both cases, as soon as the read fails.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"
)

// KVRole is the side of the disaggregated protocol an engine plays, as
// vLLM's --kv-transfer-config kv_role.
type KVRole string

// The roles. vLLM's NixlConnector plays both sides whatever its kv_role;
// enginesim's prefill role ignores do_remote_prefill (it prefills locally)
// and its decode role do_remote_decode (it frees the blocks and returns no
// parameters), so a misrouted request shows.
const (
	KVRoleBoth    KVRole = "both"    // kv_both: either side
	KVRolePrefill KVRole = "prefill" // kv_producer
	KVRoleDecode  KVRole = "decode"  // kv_consumer
)

// KVLoadFailurePolicy is what a decode engine does when a remote prefill's
// KV cannot be read, as vLLM's kv_transfer_config kv_load_failure_policy.
type KVLoadFailurePolicy string

// The policies.
const (
	KVLoadFail      KVLoadFailurePolicy = "fail"      // the request fails (500), vLLM's default
	KVLoadRecompute KVLoadFailurePolicy = "recompute" // the prompt is computed locally
)

// errGeneration is vLLM's GenerationError message, for a request that
// finished with finish reason error.
const errGeneration = "Internal server error"

// DefaultKVTransferTimeout is VLLM_NIXL_ABORT_REQUEST_TIMEOUT's default
// (vllm/envs.py, 480 s): how long a prefill engine keeps blocks no decode
// engine read.
const DefaultKVTransferTimeout = 480 * time.Second

// readPath and notifyPath are where a decode engine reads a prefill
// engine's held blocks and then frees them (enginesim's stand-in for NIXL's
// read and its notification).
const (
	readPath   = "/enginesim/kv_transfer/read"
	notifyPath = "/enginesim/kv_transfer/notify"
)

// sideChannelTimeout bounds a decode engine's read: a prefill engine that
// does not answer by then counts as a failed transfer.
const sideChannelTimeout = 5 * time.Second

func (r KVRole) producer() bool { return r == KVRoleBoth || r == KVRolePrefill }
func (r KVRole) consumer() bool { return r == KVRoleBoth || r == KVRoleDecode }

// kvTransferParams are a request's kv_transfer_params, raw by key: vLLM
// reads them as a Python dict, by truthiness and presence.
type kvTransferParams map[string]json.RawMessage

// parseKVTransferParams decodes the field: absent or null is none, an
// object its keys, anything else vLLM's validation error.
func parseKVTransferParams(raw json.RawMessage) (kvTransferParams, *requestError) {
	if !present(raw) {
		return nil, nil
	}
	if raw[0] != '{' {
		return nil, invalid("kv_transfer_params: Input should be a valid dictionary")
	}
	var p kvTransferParams
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, invalid("kv_transfer_params: %s", jsonErrorText(err))
	}
	return p, nil
}

// truthy is Python's truth of a JSON value.
func (p kvTransferParams) truthy(key string) bool {
	v := bytes.TrimSpace(p[key])
	switch string(v) {
	case "", "null", "false", `""`, "[]", "{}":
		return false
	}
	f, err := strconv.ParseFloat(string(v), 64)
	return err != nil || f != 0
}

// remoteKV is where a decode engine reads a prefill's blocks.
type remoteKV struct {
	BlockIDs  []int32 `json:"remote_block_ids"`
	EngineID  string  `json:"remote_engine_id"`
	RequestID string  `json:"remote_request_id"`
	Host      string  `json:"remote_host"`
	Port      int     `json:"remote_port"`
}

// remote returns the parameters of a remote prefill, and false when vLLM
// would not use them (update_state_after_alloc: remote_block_ids, and the
// engine id, request id, host and port keys present) or they cannot be
// read (a mistyped value fails vLLM's transfer too).
func (p kvTransferParams) remote() (remoteKV, bool) {
	if !p.truthy("remote_block_ids") {
		return remoteKV{}, false
	}
	for _, k := range []string{"remote_engine_id", "remote_request_id", "remote_host", "remote_port"} {
		if _, ok := p[k]; !ok {
			return remoteKV{}, false
		}
	}
	var rk remoteKV
	for k, dst := range map[string]any{"remote_block_ids": &rk.BlockIDs, "remote_engine_id": &rk.EngineID,
		"remote_request_id": &rk.RequestID, "remote_host": &rk.Host, "remote_port": &rk.Port} {
		if err := json.Unmarshal(p[k], dst); err != nil {
			return remoteKV{}, false
		}
	}
	return rk, rk.Host != "" && rk.Port > 0 && rk.Port < 1<<16
}

// engineID is rank i's remote_engine_id: vLLM suffixes each data-parallel
// rank's kv_transfer_config.engine_id with _dp<rank>
// (EngineCoreProc.run_engine_core, vllm/v1/engine/core.py at 00080ee1).
func (s *Server) engineID(i int) string {
	if len(s.ranks) == 1 {
		return s.cfg.EngineID
	}
	return s.cfg.EngineID + "_dp" + strconv.Itoa(i)
}

// remoteRequestID names request id in kv_transfer_params.
func (s *Server) remoteRequestID(id uint64) string {
	return s.idPrefix + strconv.FormatUint(id, 16)
}

// appendKVTransferParams renders what NixlConnector's request_finished
// returns for a prefill held for a remote decode, in its key order, naming
// sideChannel as the host and port to read them at.
func appendKVTransferParams(b []byte, sideChannel, engineID, requestID string, blocks []int32) []byte {
	host, port, _ := net.SplitHostPort(sideChannel)
	b = append(b, `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[`...)
	for i, blk := range blocks {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(blk), 10)
	}
	b = append(b, `],"remote_engine_id":`...)
	b = appendJSONString(b, engineID)
	b = append(b, `,"remote_request_id":`...)
	b = appendJSONString(b, requestID)
	b = append(b, `,"remote_host":`...)
	b = appendJSONString(b, host)
	b = append(b, `,"remote_port":`...)
	if port == "" {
		port = "null" // not host:port (a unix socket): no decode engine can read them
	}
	b = append(b, port...)
	// enginesim's ranks have no tensor parallelism.
	return append(b, `,"tp_size":1}`...)
}

// errNotHeld: the prefill engine holds no such blocks (never, no more, or
// other ones).
var errNotHeld = errors.New("no such held KV blocks: unknown request, expired, or other block ids")

// sideChannel serves a decode engine's read of held blocks (200 if held)
// or its notification that it has them (200 and the blocks freed), 404
// when they are not held.
func (s *Server) sideChannel(ctx *fasthttp.RequestCtx, free bool) {
	var rk remoteKV
	if err := json.Unmarshal(ctx.PostBody(), &rk); err != nil {
		badRequest(ctx, "invalid read: "+jsonErrorText(err))
		return
	}
	rankIndex := slices.IndexFunc(s.ranks, func(r *rank) bool { return s.engineID(r.loop.rank) == rk.EngineID })
	hex, ok := strings.CutPrefix(rk.RequestID, s.idPrefix)
	id, err := strconv.ParseUint(hex, 16, 64)
	if rankIndex < 0 || !ok || err != nil {
		writeError(ctx, fasthttp.StatusNotFound, "NotFoundError", errNotHeld.Error())
		return
	}
	l := s.ranks[rankIndex].loop
	result := make(chan bool, 1)
	select {
	case l.control <- func() { result <- l.holds(id, rk.BlockIDs, free) }:
	case <-s.stopped:
		writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", errShutdown.Error())
		return
	}
	select {
	case ok = <-result:
	case <-s.stopped:
		writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", errShutdown.Error())
		return
	}
	if !ok {
		writeError(ctx, fasthttp.StatusNotFound, "NotFoundError", errNotHeld.Error())
		return
	}
	ctx.SetContentType("application/json")
	key := `{"held_blocks":`
	if free {
		key = `{"released_blocks":`
	}
	ctx.SetBodyString(key + strconv.Itoa(len(rk.BlockIDs)) + `}`)
}

// notifyRemote tells the prefill engine the decode engine is done with its
// blocks, in the background: vLLM's decode side does not wait on its
// notification either, and one that fails leaves the blocks to expire.
func (s *Server) notifyRemote(rk *remoteKV) {
	go func() {
		if err := s.postSideChannel(*rk, notifyPath); err != nil {
			s.cfg.Logger.Debug().Err(err).Str("remote_engine_id", rk.EngineID).Msg("KV transfer notification failed: the prefill engine's blocks will expire")
		}
	}()
}

// postSideChannel posts rk to a prefill engine's side channel at path: nil
// when it holds the blocks (and, for notifyPath, freed them).
func (s *Server) postSideChannel(rk remoteKV, path string) error {
	body, err := json.Marshal(rk)
	if err != nil {
		return err
	}
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI("http://" + net.JoinHostPort(rk.Host, strconv.Itoa(rk.Port)) + path)
	req.Header.SetMethod(fasthttp.MethodPost)
	req.Header.SetContentType("application/json")
	req.SetBody(body)
	if err := s.sideClient.DoTimeout(req, resp, sideChannelTimeout); err != nil {
		return err
	}
	if resp.StatusCode() != fasthttp.StatusOK {
		return fmt.Errorf("prefill engine %s:%d answered %d: %s", rk.Host, rk.Port, resp.StatusCode(), resp.Body())
	}
	return nil
}

// kvTransfer resolves a generation request's kv_transfer_params: whether
// it is a prefill to hold for a remote decode, or a decode whose prompt KV
// was read from a remote prefill (false for both when the parameters
// cannot be used: the prompt is computed locally), or a decode whose read
// failed under the fail policy (failed: the request fails). A remote
// prefill's remote is where to notify once its KV is in.
func (s *Server) kvTransfer(rk *rank, p kvTransferParams) (remoteDecode bool, remote *remoteKV, failed bool) {
	if p == nil {
		return false, nil, false
	}
	role := s.cfg.KVRole
	if p.truthy("do_remote_prefill") {
		if !role.consumer() {
			return false, nil, false
		}
		r, ok := p.remote()
		if !ok {
			s.cfg.Logger.Warn().Msg("got invalid kv_transfer_params: this request will not utilize KV transfer")
			return false, nil, false
		}
		if err := s.postSideChannel(r, readPath); err != nil {
			rk.metrics.countFailedTransfer()
			s.cfg.Logger.Debug().Err(err).Str("remote_engine_id", r.EngineID).Str("kv_load_failure_policy", string(s.cfg.KVLoadFailurePolicy)).Msg("KV transfer failed")
			return false, nil, s.cfg.KVLoadFailurePolicy == KVLoadFail
		}
		return false, &r, false
	}
	return role.producer() && p.truthy("do_remote_decode"), nil, false
}

// writeGenerationError answers a request that failed in the engine as
// vLLM's API server does: a 500 ErrorResponse, or for a stream the error
// as its one event before [DONE].
func writeGenerationError(ctx *fasthttp.RequestCtx, stream bool) {
	if !stream {
		writeError(ctx, fasthttp.StatusInternalServerError, "InternalServerError", errGeneration)
		return
	}
	ctx.SetContentType("text/event-stream; charset=utf-8")
	ctx.SetBodyString(`data: {"error":{"message":"` + errGeneration + `","type":"InternalServerError","param":null,"code":500}}` + "\n\ndata: [DONE]\n\n")
}
