package kvevents

import "fmt"

// Format selects the wire layout AppendBatch produces. Every Format encodes
// the batch as an array [ts, events, dp_rank] (dp_rank dropped when the Batch
// has none, as msgspec's omit_defaults does) and picks msgspec's smallest
// encoding for every value, so the bytes equal what the Python engine emits.
type Format uint8

const (
	// FormatVLLMMap is vLLM v0.26+ (after vllm-project/vllm#42892): events are
	// maps {"type": tag, field: value, ...} in declaration order, with
	// defaulted optional fields omitted. A non-empty CacheSalt is added as a
	// trailing "cache_salt" key (not a vLLM field; consumers ignore it).
	FormatVLLMMap Format = iota
	// FormatVLLMArray is vLLM before #42892: events are arrays with the tag
	// first; trailing defaulted fields are dropped. CacheSalt is not encoded.
	FormatVLLMArray
	// FormatSGLang is SGLang (mid-2026): BlockStored as the 7-element array
	// [tag, hashes, parent, tokens, block_size, lora_id, medium] plus a
	// {"cache_salt": ...} map when salted, BlockRemoved as [tag, hashes],
	// hashes as signed int64. LoRAName, GroupIdx, SpecKind, SlidingWindow,
	// ExtraKeys and a removal's Medium are not encoded.
	FormatSGLang
)

func (f Format) String() string {
	switch f {
	case FormatVLLMMap:
		return "vllm"
	case FormatVLLMArray:
		return "vllm-array"
	case FormatSGLang:
		return "sglang"
	}
	return fmt.Sprintf("Format(%d)", uint8(f))
}

// ParseFormat parses the names String returns.
func ParseFormat(s string) (Format, error) {
	for _, f := range []Format{FormatVLLMMap, FormatVLLMArray, FormatSGLang} {
		if s == f.String() {
			return f, nil
		}
	}
	return 0, fmt.Errorf("kvevents: unknown event format %q (want vllm, vllm-array or sglang)", s)
}

// AppendBatch appends the msgpack encoding of b in format f to dst. Events of
// KindUnknown are left out.
func AppendBatch(dst []byte, b *Batch, f Format) []byte {
	if b.DPRank >= 0 {
		dst = appendArrayHeader(dst, 3)
	} else {
		dst = appendArrayHeader(dst, 2)
	}
	dst = appendFloat(dst, b.TS)
	n := 0
	for i := range b.Events {
		if b.Events[i].Kind != KindUnknown {
			n++
		}
	}
	dst = appendArrayHeader(dst, n)
	for i := range b.Events {
		ev := &b.Events[i]
		switch f {
		case FormatVLLMArray:
			dst = appendVLLMArrayEvent(dst, ev)
		case FormatSGLang:
			dst = appendSGLangEvent(dst, ev)
		default:
			dst = appendVLLMMapEvent(dst, ev)
		}
	}
	if b.DPRank >= 0 {
		dst = appendInt(dst, int64(b.DPRank))
	}
	return dst
}

func appendHashes(dst []byte, hs []uint64, signed bool) []byte {
	dst = appendArrayHeader(dst, len(hs))
	for _, h := range hs {
		dst = appendHash(dst, h, signed)
	}
	return dst
}

func appendHash(dst []byte, h uint64, signed bool) []byte {
	if signed {
		return appendInt(dst, int64(h))
	}
	return appendUint(dst, h)
}

func appendParent(dst []byte, ev *Event, signed bool) []byte {
	if !ev.HasParent {
		return appendNil(dst)
	}
	return appendHash(dst, ev.ParentHash, signed)
}

func appendTokens(dst []byte, ev *Event) []byte {
	ts := ev.TokenIDs
	dst = appendArrayHeader(dst, len(ts))
	for i, t := range ts {
		if !ev.Bigram {
			dst = appendUint(dst, uint64(t))
			continue
		}
		next := ev.BigramLast
		if i+1 < len(ts) {
			next = ts[i+1]
		}
		dst = appendUint(appendUint(appendArrayHeader(dst, 2), uint64(t)), uint64(next))
	}
	return dst
}

func appendLoRAID(dst []byte, id int64) []byte {
	if id == 0 {
		return appendNil(dst)
	}
	return appendInt(dst, id)
}

// storedTail returns how many of BlockStored's defaulted fields (extra_keys,
// group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window) an array
// encoding carries: up to the last one that is set.
func storedTail(ev *Event) int {
	switch {
	case ev.SlidingWindow != 0:
		return 4
	case ev.SpecKind != "":
		return 3
	case ev.HasGroupIdx:
		return 2
	case len(ev.ExtraKeys) > 0:
		return 1
	}
	return 0
}

func appendExtraKeys(dst []byte, ev *Event) []byte {
	if len(ev.ExtraKeys) == 0 {
		return appendNil(dst)
	}
	return append(dst, ev.ExtraKeys...)
}

func appendGroupIdx(dst []byte, ev *Event) []byte {
	if !ev.HasGroupIdx {
		return appendNil(dst)
	}
	return appendInt(dst, int64(ev.GroupIdx))
}

func appendSlidingWindow(dst []byte, ev *Event) []byte {
	if ev.SlidingWindow == 0 {
		return appendNil(dst)
	}
	return appendInt(dst, int64(ev.SlidingWindow))
}

func appendVLLMArrayEvent(dst []byte, ev *Event) []byte {
	switch ev.Kind {
	case KindBlockStored:
		tail := storedTail(ev)
		dst = appendArrayHeader(dst, 8+tail)
		dst = appendStr(dst, "BlockStored")
		dst = appendHashes(dst, ev.BlockHashes, false)
		dst = appendParent(dst, ev, false)
		dst = appendTokens(dst, ev)
		dst = appendInt(dst, int64(ev.BlockSize))
		dst = appendLoRAID(dst, ev.LoRAID)
		dst = appendStrOrNil(dst, ev.Medium)
		dst = appendStrOrNil(dst, ev.LoRAName)
		if tail >= 1 {
			dst = appendExtraKeys(dst, ev)
		}
		if tail >= 2 {
			dst = appendGroupIdx(dst, ev)
		}
		if tail >= 3 {
			dst = appendStrOrNil(dst, ev.SpecKind)
		}
		if tail >= 4 {
			dst = appendSlidingWindow(dst, ev)
		}
	case KindBlockRemoved:
		if ev.HasGroupIdx {
			dst = appendArrayHeader(dst, 4)
		} else {
			dst = appendArrayHeader(dst, 3)
		}
		dst = appendStr(dst, "BlockRemoved")
		dst = appendHashes(dst, ev.BlockHashes, false)
		dst = appendStrOrNil(dst, ev.Medium)
		if ev.HasGroupIdx {
			dst = appendInt(dst, int64(ev.GroupIdx))
		}
	case KindAllBlocksCleared:
		dst = appendArrayHeader(dst, 1)
		dst = appendStr(dst, "AllBlocksCleared")
	}
	return dst
}

func appendVLLMMapEvent(dst []byte, ev *Event) []byte {
	switch ev.Kind {
	case KindBlockStored:
		n := 8 // type and the seven fields without defaults
		if len(ev.ExtraKeys) > 0 {
			n++
		}
		if ev.HasGroupIdx {
			n++
		}
		if ev.SpecKind != "" {
			n++
		}
		if ev.SlidingWindow != 0 {
			n++
		}
		if ev.CacheSalt != "" {
			n++
		}
		dst = appendMapHeader(dst, n)
		dst = appendStr(appendStr(dst, "type"), "BlockStored")
		dst = appendHashes(appendStr(dst, "block_hashes"), ev.BlockHashes, false)
		dst = appendParent(appendStr(dst, "parent_block_hash"), ev, false)
		dst = appendTokens(appendStr(dst, "token_ids"), ev)
		dst = appendInt(appendStr(dst, "block_size"), int64(ev.BlockSize))
		dst = appendLoRAID(appendStr(dst, "lora_id"), ev.LoRAID)
		dst = appendStrOrNil(appendStr(dst, "medium"), ev.Medium)
		dst = appendStrOrNil(appendStr(dst, "lora_name"), ev.LoRAName)
		if len(ev.ExtraKeys) > 0 {
			dst = appendExtraKeys(appendStr(dst, "extra_keys"), ev)
		}
		if ev.HasGroupIdx {
			dst = appendGroupIdx(appendStr(dst, "group_idx"), ev)
		}
		if ev.SpecKind != "" {
			dst = appendStr(appendStr(dst, "kv_cache_spec_kind"), ev.SpecKind)
		}
		if ev.SlidingWindow != 0 {
			dst = appendSlidingWindow(appendStr(dst, "kv_cache_spec_sliding_window"), ev)
		}
		if ev.CacheSalt != "" {
			dst = appendStr(appendStr(dst, "cache_salt"), ev.CacheSalt)
		}
	case KindBlockRemoved:
		if ev.HasGroupIdx {
			dst = appendMapHeader(dst, 4)
		} else {
			dst = appendMapHeader(dst, 3)
		}
		dst = appendStr(appendStr(dst, "type"), "BlockRemoved")
		dst = appendHashes(appendStr(dst, "block_hashes"), ev.BlockHashes, false)
		dst = appendStrOrNil(appendStr(dst, "medium"), ev.Medium)
		if ev.HasGroupIdx {
			dst = appendGroupIdx(appendStr(dst, "group_idx"), ev)
		}
	case KindAllBlocksCleared:
		dst = appendMapHeader(dst, 1)
		dst = appendStr(appendStr(dst, "type"), "AllBlocksCleared")
	}
	return dst
}

func appendSGLangEvent(dst []byte, ev *Event) []byte {
	switch ev.Kind {
	case KindBlockStored:
		if ev.CacheSalt != "" {
			dst = appendArrayHeader(dst, 8)
		} else {
			dst = appendArrayHeader(dst, 7)
		}
		dst = appendStr(dst, "BlockStored")
		dst = appendHashes(dst, ev.BlockHashes, true)
		dst = appendParent(dst, ev, true)
		dst = appendTokens(dst, ev)
		dst = appendInt(dst, int64(ev.BlockSize))
		dst = appendLoRAID(dst, ev.LoRAID)
		dst = appendStrOrNil(dst, ev.Medium)
		if ev.CacheSalt != "" {
			dst = appendMapHeader(dst, 1)
			dst = appendStr(appendStr(dst, "cache_salt"), ev.CacheSalt)
		}
	case KindBlockRemoved:
		dst = appendArrayHeader(dst, 2)
		dst = appendStr(dst, "BlockRemoved")
		dst = appendHashes(dst, ev.BlockHashes, true)
	case KindAllBlocksCleared:
		dst = appendArrayHeader(dst, 1)
		dst = appendStr(dst, "AllBlocksCleared")
	}
	return dst
}
