package residentset

import (
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/vmihailenco/msgpack/v5"
)

// extraKeys reads vLLM's per-block extra_keys (the tuple the engine mixed
// into each block's hash: LoRA name, multimodal items, cache salt for the
// block at token 0, prompt-embedding digests). kvmesh keys cover the LoRA
// adapter and the cache salt through the seed; anything else (an image, an
// embedding) makes the block's content more than its tokens, so it and the
// blocks after it cannot be keyed: the router, which keys text tokens only,
// must never find them.
//
// It returns the cache salt found in a root event's first block ("" if
// none) and how many leading blocks can be keyed.
func extraKeys(ev *kvevents.Event) (salt string, keyable int) {
	n := len(ev.BlockHashes)
	if allNil(ev.ExtraKeys) {
		return "", n
	}
	var perBlock []any
	if err := msgpack.Unmarshal(ev.ExtraKeys, &perBlock); err != nil {
		return "", 0 // unreadable: key nothing rather than guess
	}
	for i := range min(n, len(perBlock)) {
		if perBlock[i] == nil {
			continue
		}
		tuple, ok := perBlock[i].([]any)
		if !ok {
			return salt, i
		}
		for _, x := range tuple {
			switch v := x.(type) {
			case string:
				switch {
				case v == ev.LoRAName && v != "":
				case i == 0 && !ev.HasParent && salt == "":
					salt = v // cache_salt rides on the block at token 0
				default:
					return salt, i
				}
			case int64:
				if ev.LoRAID == 0 || v != ev.LoRAID { // older vLLM: lora_int_id
					return salt, i
				}
			case uint64:
				if ev.LoRAID <= 0 || v != uint64(ev.LoRAID) {
					return salt, i
				}
			case int8, int16, int32, uint8, uint16, uint32:
				if ev.LoRAID == 0 || toInt64(v) != ev.LoRAID {
					return salt, i
				}
			default:
				return salt, i
			}
		}
	}
	return salt, n
}

func toInt64(v any) int64 {
	switch v := v.(type) {
	case int8:
		return int64(v)
	case int16:
		return int64(v)
	case int32:
		return int64(v)
	case uint8:
		return int64(v)
	case uint16:
		return int64(v)
	case uint32:
		return int64(v)
	}
	return 0
}

// allNil reports whether raw is empty or a msgpack array of nils, what
// text-only requests send; it spares them a decode.
func allNil(raw []byte) bool {
	if len(raw) == 0 {
		return true
	}
	var body []byte
	switch c := raw[0]; {
	case c >= 0x90 && c <= 0x9f: // fixarray
		body = raw[1:]
		if len(body) != int(c&0x0f) {
			return false
		}
	case c == 0xdc && len(raw) >= 3: // array 16
		body = raw[3:]
		if len(body) != int(raw[1])<<8|int(raw[2]) {
			return false
		}
	default:
		return false
	}
	for _, b := range body {
		if b != 0xc0 {
			return false
		}
	}
	return true
}
