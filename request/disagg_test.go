package request

import (
	"encoding/json"
	"testing"
)

func TestPrefillAndDecodeBodies(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":200}`)
	pre, err := PrefillBody(body, Chat)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":200,` +
		`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null},` +
		`"stream":false,"stream_options":null,"max_tokens":1,"max_completion_tokens":1}`
	if string(pre) != want {
		t.Fatalf("prefill body\n%s\nwant\n%s", pre, want)
	}
	// As a Python or Go decoder reads it: the appended fields win.
	var seen map[string]json.RawMessage
	if err := json.Unmarshal(pre, &seen); err != nil || string(seen["stream"]) != "false" || string(seen["max_tokens"]) != "1" || string(seen["stream_options"]) != "null" {
		t.Fatalf("decoded %v %v", seen, err)
	}
	if pre, _ := PrefillBody([]byte(`{"prompt":"x"}`), Completion); string(pre) != `{"prompt":"x","kv_transfer_params":`+prefillParams+`,"stream":false,"stream_options":null,"max_tokens":1}` {
		t.Fatalf("completion prefill %s", pre)
	}
	if _, err := PrefillBody([]byte(`[1]`), Chat); err == nil {
		t.Fatal("a body that is no object was accepted")
	}

	answer := []byte(`{"id":"cmpl-1","choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[3,4],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":8100,"tp_size":1},"usage":{"prompt_tokens":40}}`)
	params, ok := TransferParams(answer)
	if !ok || string(params) != `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[3,4],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":8100,"tp_size":1}` {
		t.Fatalf("params %s %v", params, ok)
	}
	dec, err := DecodeBody(body, params)
	if err != nil || string(dec) != string(body[:len(body)-1])+`,"kv_transfer_params":`+string(params)+`}` {
		t.Fatalf("decode body %s %v", dec, err)
	}
	for _, bad := range []string{`{}`, `{"kv_transfer_params":null}`, `{"kv_transfer_params":[1]}`, `{"kv_transfer_params":{"do_remote_prefill":false}}`, `not json`} {
		if p, ok := TransferParams([]byte(bad)); ok {
			t.Errorf("%s: params %s", bad, p)
		}
	}
}

func FuzzTransferParams(f *testing.F) {
	f.Add([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1]}}`))
	f.Add([]byte(`{"kv_transfer_params":"x"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, ok := TransferParams(b)
		if ok && !json.Valid(p) {
			t.Fatalf("invalid params %q from %q", p, b)
		}
	})
}
