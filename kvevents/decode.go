package kvevents

import "unsafe"

// MaxBatchEvents bounds the events of one batch: a larger one is a
// *DecodeError before anything is allocated. Each event decodes into a
// ~230-byte Event, so without it a 20 MB payload of 5-byte events took
// 3.4 GB. It is far above what an engine step publishes: vLLM sends one
// BlockStored per request and one BlockRemoved per evicted block (at most
// max_num_batched_tokens/block_size a step), SGLang with page size 1 one
// BlockStored per token (a 128k-token prefill in one step).
const MaxBatchEvents = 1 << 18

// maxRetainedBytes bounds the buffers a reused Batch keeps between
// decodes. Steady batches hold a few KiB and reuse everything; after an
// outlier (a huge prefill, or a flood) grows them past this, the next decode
// drops them, so one outlier does not pin its memory for good.
const maxRetainedBytes = 4 << 20

const eventBytes = int(unsafe.Sizeof(Event{}))

// DecodeBatch decodes one msgpack KVEventBatch payload into into, reusing
// into.Events and the slices of the events it already holds, so a caller that
// keeps one Batch decodes without allocating once the slices have grown.
//
// Accepted shapes (see the package comment): the batch as an array
// [ts, events, dp_rank?] or a map {ts, events, data_parallel_rank |
// attn_dp_rank}; each event as an array with its tag first or a map with a
// "type" key. Missing trailing fields read as absent, unknown trailing fields
// and unknown keys are skipped, and an event with an unknown tag decodes as
// KindUnknown with no fields. Known fields of the wrong type, truncated or
// trailing bytes return a *DecodeError; the contents of into are then
// unspecified but into stays safe to reuse. A batch of more than
// MaxBatchEvents events is a *DecodeError.
func DecodeBatch(payload []byte, into *Batch) error {
	if into.held > maxRetainedBytes {
		into.Events, into.held = nil, 0
	}
	defer into.countHeld()
	r := reader{buf: payload, event: -1}
	into.TS = 0
	into.DPRank = -1
	into.Events = into.Events[:0]

	n, isMap, err := r.container()
	if err != nil {
		return err
	}
	if isMap {
		for i := 0; i < n; i++ {
			key, err := r.str()
			if err != nil {
				return err
			}
			switch string(key) {
			case "ts":
				r.field = "ts"
				into.TS, err = r.float()
			case "events":
				r.field = "events"
				err = r.events(into)
			case "data_parallel_rank", "attn_dp_rank":
				r.field = string(key)
				err = r.rank(into)
			default:
				r.field = ""
				err = r.skip(0)
			}
			if err != nil {
				return err
			}
			r.field = ""
		}
	} else {
		if n < 2 {
			return r.fail("batch array has %d elements, want at least 2 (ts, events)", n)
		}
		r.field = "ts"
		if into.TS, err = r.float(); err != nil {
			return err
		}
		r.field = "events"
		if err := r.events(into); err != nil {
			return err
		}
		if n >= 3 {
			r.field = "data_parallel_rank"
			if err := r.rank(into); err != nil {
				return err
			}
		}
		r.field = ""
		for i := 3; i < n; i++ {
			if err := r.skip(0); err != nil {
				return err
			}
		}
	}
	if r.off != len(payload) {
		return r.fail("%d trailing bytes after the batch", len(payload)-r.off)
	}
	return nil
}

// Outsized reports whether an outlier grew b's buffers past what a reused
// Batch keeps: the next decode drops them, and their memory is garbage from
// then on.
func (b *Batch) Outsized() bool { return b.held > maxRetainedBytes }

// countHeld sums what b's buffers hold, every slot's (a slot past len
// keeps the slices of an earlier, longer batch).
func (b *Batch) countHeld() {
	all := b.Events[:cap(b.Events)]
	n := len(all) * eventBytes
	for i := range all {
		ev := &all[i]
		n += 8*cap(ev.BlockHashes) + 4*cap(ev.TokenIDs) + cap(ev.ExtraKeys) +
			len(ev.Medium) + len(ev.LoRAName) + len(ev.SpecKind) + len(ev.CacheSalt)
	}
	b.held = n
}

func (r *reader) rank(into *Batch) error {
	if r.skipNil() {
		into.DPRank = -1
		return nil
	}
	v, err := r.int()
	if err == nil && v < 0 {
		return r.fail("negative data_parallel_rank %d", v)
	}
	into.DPRank = v
	return err
}

func (r *reader) events(into *Batch) error {
	n, err := r.array()
	if err != nil {
		return err
	}
	if n > MaxBatchEvents {
		return r.fail("%d events in one batch, more than the %d allowed", n, MaxBatchEvents)
	}
	for i := 0; i < n; i++ {
		// Grow by one, reusing the slot (and its slices) if the backing
		// array already has one; the count is bounded by the payload size.
		k := len(into.Events)
		if k < cap(into.Events) {
			into.Events = into.Events[:k+1]
		} else {
			into.Events = append(into.Events, Event{})
		}
		r.event = i
		if err := r.decodeEvent(&into.Events[k]); err != nil {
			return err
		}
	}
	r.event = -1
	return nil
}

// decodeEvent fills ev from an array- or map-encoded event.
func (r *reader) decodeEvent(ev *Event) error {
	old := *ev // strings of the previous occupant, to reuse when equal
	*ev = Event{
		BlockHashes: ev.BlockHashes[:0],
		TokenIDs:    ev.TokenIDs[:0],
		ExtraKeys:   ev.ExtraKeys[:0],
	}
	r.field = ""
	n, isMap, err := r.container()
	if err != nil {
		return err
	}
	if isMap {
		for i := 0; i < n; i++ {
			key, err := r.str()
			if err != nil {
				return err
			}
			if string(key) == "type" {
				r.field = "type"
				tag, err := r.str()
				if err != nil {
					return err
				}
				ev.Kind = kindOf(tag)
				continue
			}
			if err := r.field1(ev, &old, fieldOf(key)); err != nil {
				return err
			}
		}
	} else {
		if n == 0 {
			return r.fail("empty event array (no tag)")
		}
		r.field = "type"
		tag, err := r.str()
		if err != nil {
			return err
		}
		ev.Kind = kindOf(tag)
		for pos := 1; pos < n; pos++ {
			if err := r.positionalField(ev, &old, pos); err != nil {
				return err
			}
		}
	}
	r.field = ""
	keepOnlyKindFields(ev)
	return nil
}

// keepOnlyKindFields clears fields that ev's kind does not have (a map event
// may carry any key), so every decoded event is one an encoder can reproduce.
func keepOnlyKindFields(ev *Event) {
	switch ev.Kind {
	case KindBlockStored:
		return
	case KindBlockRemoved:
		*ev = Event{Kind: ev.Kind, BlockHashes: ev.BlockHashes, Medium: ev.Medium,
			GroupIdx: ev.GroupIdx, HasGroupIdx: ev.HasGroupIdx,
			TokenIDs: ev.TokenIDs[:0], ExtraKeys: ev.ExtraKeys[:0]}
	default:
		*ev = Event{Kind: ev.Kind, BlockHashes: ev.BlockHashes[:0], TokenIDs: ev.TokenIDs[:0], ExtraKeys: ev.ExtraKeys[:0]}
	}
}

func kindOf(tag []byte) Kind {
	switch string(tag) {
	case "BlockStored":
		return KindBlockStored
	case "BlockRemoved":
		return KindBlockRemoved
	case "AllBlocksCleared":
		return KindAllBlocksCleared
	}
	return KindUnknown
}

// fieldID names an event field; the decoder dispatches on it rather than on
// strings so map-encoded events cost little more than array-encoded ones.
type fieldID uint8

const (
	fNone fieldID = iota
	fBlockHashes
	fParent
	fTokenIDs
	fBlockSize
	fLoRAID
	fMedium
	fLoRAName
	fExtraKeys
	fGroupIdx
	fSpecKind
	fSlidingWindow
	fCacheSalt
	fMetadata
)

// fieldNames are the wire names, also used to label errors.
var fieldNames = [...]string{
	fBlockHashes: "block_hashes", fParent: "parent_block_hash", fTokenIDs: "token_ids",
	fBlockSize: "block_size", fLoRAID: "lora_id", fMedium: "medium", fLoRAName: "lora_name",
	fExtraKeys: "extra_keys", fGroupIdx: "group_idx", fSpecKind: "kv_cache_spec_kind",
	fSlidingWindow: "kv_cache_spec_sliding_window", fCacheSalt: "cache_salt", fMetadata: "metadata",
}

// Positions of fields in array-encoded events (the tag is at 0).
var (
	storedFields = [...]fieldID{fNone, fBlockHashes, fParent, fTokenIDs, fBlockSize, fLoRAID,
		fMedium, fLoRAName, fExtraKeys, fGroupIdx, fSpecKind, fSlidingWindow}
	removedFields = [...]fieldID{fNone, fBlockHashes, fMedium, fGroupIdx}
)

func (r *reader) positionalField(ev *Event, old *Event, pos int) error {
	id := fNone
	switch ev.Kind {
	case KindBlockStored:
		if pos < len(storedFields) {
			id = storedFields[pos]
		}
		// SGLang (#30827) appends a metadata map where vLLM has lora_name.
		if pos == 7 && r.peekIsMap() {
			id = fMetadata
		}
	case KindBlockRemoved:
		if pos < len(removedFields) {
			id = removedFields[pos]
		}
	}
	return r.field1(ev, old, id)
}

func fieldOf(key []byte) fieldID {
	switch string(key) {
	case "block_hashes":
		return fBlockHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokenIDs
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoRAID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoRAName
	case "extra_keys":
		return fExtraKeys
	case "group_idx":
		return fGroupIdx
	case "kv_cache_spec_kind":
		return fSpecKind
	case "kv_cache_spec_sliding_window":
		return fSlidingWindow
	case "cache_salt":
		return fCacheSalt
	case "metadata":
		return fMetadata
	}
	return fNone
}

// field1 decodes field id into ev; fNone skips the value. Every field may be
// nil, which reads as absent.
func (r *reader) field1(ev *Event, old *Event, id fieldID) error {
	r.field = fieldNames[id]
	var err error
	switch id {
	case fNone:
		err = r.skip(0)
	case fBlockHashes:
		var n int
		if n, err = r.array(); err != nil {
			return err
		}
		ev.BlockHashes = ev.BlockHashes[:0]
		for i := 0; i < n; i++ {
			h, err := r.hash()
			if err != nil {
				return err
			}
			ev.BlockHashes = append(ev.BlockHashes, h)
		}
	case fParent:
		ev.ParentHash, ev.HasParent = 0, false
		if !r.skipNil() {
			ev.ParentHash, err = r.hash()
			ev.HasParent = true
		}
	case fTokenIDs:
		var n int
		if n, err = r.array(); err != nil {
			return err
		}
		ev.TokenIDs = ev.TokenIDs[:0]
		ev.Bigram, ev.BigramLast = n > 0 && r.peekIsArray(), 0
		for i := 0; i < n; i++ {
			if ev.Bigram {
				if m, err := r.array(); err != nil || m != 2 {
					return r.fail("token_ids: a bigram must be a pair of ids")
				}
			}
			t, err := r.uint32()
			if err != nil {
				return err
			}
			ev.TokenIDs = append(ev.TokenIDs, t)
			if ev.Bigram {
				if ev.BigramLast, err = r.uint32(); err != nil {
					return err
				}
			}
		}
	case fBlockSize:
		ev.BlockSize, err = r.int()
	case fLoRAID:
		ev.LoRAID = 0
		if !r.skipNil() {
			ev.LoRAID, err = r.int64()
		}
	case fMedium:
		ev.Medium, err = r.optStr(old.Medium)
	case fLoRAName:
		ev.LoRAName, err = r.optStr(old.LoRAName)
	case fSpecKind:
		ev.SpecKind, err = r.optStr(old.SpecKind)
	case fCacheSalt:
		ev.CacheSalt, err = r.optStr(old.CacheSalt)
	case fGroupIdx:
		ev.GroupIdx, ev.HasGroupIdx = 0, false
		if !r.skipNil() {
			ev.GroupIdx, err = r.int()
			ev.HasGroupIdx = true
		}
	case fSlidingWindow:
		ev.SlidingWindow, err = r.int()
	case fExtraKeys:
		ev.ExtraKeys = ev.ExtraKeys[:0]
		if !r.skipNil() {
			start := r.off
			if err = r.skip(0); err == nil {
				ev.ExtraKeys = append(ev.ExtraKeys, r.buf[start:r.off]...)
			}
		}
	case fMetadata:
		err = r.metadata(ev, old)
	}
	return err
}

// metadata reads SGLang's {"cache_salt": ...} map.
func (r *reader) metadata(ev *Event, old *Event) error {
	if r.skipNil() {
		return nil
	}
	start := r.off
	n, isMap, err := r.container()
	if err != nil {
		return err
	}
	if !isMap {
		r.off = start
		return r.fail("want map, got array")
	}
	for i := 0; i < n; i++ {
		key, err := r.str()
		if err != nil {
			return err
		}
		if string(key) == "cache_salt" {
			r.field = "cache_salt"
			if ev.CacheSalt, err = r.optStr(old.CacheSalt); err != nil {
				return err
			}
			r.field = "metadata"
			continue
		}
		if err := r.skip(0); err != nil {
			return err
		}
	}
	return nil
}

// optStr reads a string or nil (""). It returns prev when the bytes equal it
// and a constant for common values, so steady-state decoding does not
// allocate strings.
func (r *reader) optStr(prev string) (string, error) {
	if r.skipNil() {
		return "", nil
	}
	b, err := r.str()
	if err != nil {
		return "", err
	}
	if string(b) == prev {
		return prev, nil
	}
	switch string(b) {
	case "":
		return "", nil
	case "GPU":
		return "GPU", nil
	case "CPU":
		return "CPU", nil
	case "cpu":
		return "cpu", nil
	case "full_attention":
		return "full_attention", nil
	}
	return string(b), nil
}
