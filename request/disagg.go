package request

import (
	"bytes"
	"encoding/json"
)

// The disaggregated protocol's bodies, as vLLM's own disaggregated proxy
// builds them (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py
// and examples/online_serving/disaggregated_serving, vLLM main e0099301,
// NixlConnector version 2): the prefill is the client's request with
// kv_transfer_params asking the engine to hold the prompt's KV for a
// remote decode, one token, no stream and no stream_options; the decode
// is the client's request with the kv_transfer_params the prefill
// answered. Fields are appended (decoders keep the last of duplicate
// keys), so the client's body is never decoded again.

// prefillParams asks a prefill engine to hold the prompt's KV for a
// remote decode, in the key order vLLM's proxy sends.
const prefillParams = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// PrefillBody is the body of a split request's prefill: body (a chat or
// completion request of kind k) computing its prompt and one token, its KV
// held for the decode.
func PrefillBody(body []byte, k Kind) ([]byte, error) {
	members := `"kv_transfer_params":` + prefillParams + `,"stream":false,"stream_options":null,"max_tokens":1`
	if k == Chat {
		members += `,"max_completion_tokens":1`
	}
	return appendMembers(body, members)
}

// DecodeBody is the body of a split request's decode: body with the
// kv_transfer_params a prefill answered.
func DecodeBody(body, params []byte) ([]byte, error) {
	return appendField(body, "kv_transfer_params", params)
}

// TransferParams returns the kv_transfer_params of a prefill's answer,
// false when it has none an engine could read (absent, null, not an
// object, or not asking for a remote prefill).
func TransferParams(answer []byte) ([]byte, bool) {
	var a struct {
		KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	}
	if json.Unmarshal(answer, &a) != nil {
		return nil, false
	}
	p := bytes.TrimSpace(a.KVTransferParams)
	if len(p) == 0 || p[0] != '{' {
		return nil, false
	}
	var fields struct {
		DoRemotePrefill bool            `json:"do_remote_prefill"`
		BlockIDs        json.RawMessage `json:"remote_block_ids"`
	}
	if json.Unmarshal(p, &fields) != nil || !fields.DoRemotePrefill {
		return nil, false
	}
	return p, true
}
