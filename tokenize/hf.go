package tokenize

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"unicode/utf8"
)

// ErrInvalidUTF8 is returned for prompts that are not valid UTF-8 (HF's
// tokenizers only ever see Python str, which always is).
var ErrInvalidUTF8 = errors.New("tokenize: prompt is not valid UTF-8")

// HF is a HuggingFace fast tokenizer (tokenizer.json) run in pure Go,
// producing the ids the Rust tokenizers library produces. It is safe for
// concurrent use.
type HF struct {
	added     *addedMatcher // added tokens matched on raw text (normalized: false)
	addedNorm *addedMatcher // added tokens matched after normalization
	normalize normalizer
	pre       []preTokenizer
	model     *bpeModel
	// The post-processor for a single sequence: ids before and after it.
	postBefore, postAfter []uint32
	segments              *segmentCache
	segmentMisses         atomic.Int64 // segments tokenized, not found in the cache
	encoders              sync.Pool

	// From tokenizer_config.json (LoadDir).
	bosToken, eosToken string
	chat               chatRenderer
	chatErr            error
	// wordCut: a text cut at a word end encodes as the whole text starts
	// (wordCutSafe, decided at load).
	wordCut bool
}

// Option configures a tokenizer at load time.
type Option func(*options)

type options struct {
	segmentCacheBytes int64
	pieceCacheEntries int
	regexOnly         bool // tests: no hand-written scanners
	extraAdded        []addedToken
	chatTemplate      *string
}

// DefaultSegmentCacheBytes bounds the segment cache unless
// WithSegmentCacheBytes says otherwise.
const DefaultSegmentCacheBytes = 64 << 20

// WithSegmentCacheBytes bounds the memory of the cache that keeps the ids of
// text between special tokens (evicted in insertion order; at least 32 MiB,
// taken as needed). 0 disables it.
func WithSegmentCacheBytes(n int64) Option {
	return func(o *options) { o.segmentCacheBytes = n }
}

// Load builds a tokenizer from the contents of a tokenizer.json file.
func Load(tokenizerJSON []byte, opts ...Option) (*HF, error) {
	o := options{segmentCacheBytes: DefaultSegmentCacheBytes, pieceCacheEntries: 1 << 14}
	for _, opt := range opts {
		opt(&o)
	}
	var f struct {
		AddedTokens   []addedToken    `json:"added_tokens"`
		Normalizer    json.RawMessage `json:"normalizer"`
		PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
		PostProcessor json.RawMessage `json:"post_processor"`
		Model         modelJSON       `json:"model"`
	}
	if err := json.Unmarshal(tokenizerJSON, &f); err != nil {
		return nil, fmt.Errorf("tokenize: tokenizer.json: %w", err)
	}
	t := &HF{}
	var err error
	if t.normalize, err = parseNormalizer(f.Normalizer); err != nil {
		return nil, err
	}
	if t.pre, err = parsePreTokenizer(f.PreTokenizer, o.regexOnly); err != nil {
		return nil, err
	}
	byteLevel := false
	for k, p := range t.pre {
		if _, ok := p.(*byteLevelPre); ok {
			if k != len(t.pre)-1 {
				return nil, &UnsupportedError{"pre_tokenizer", "ByteLevel followed by another pre-tokenizer"}
			}
			byteLevel = true
		}
	}
	if t.model, err = parseBPE(f.Model, byteLevel); err != nil {
		return nil, err
	}
	if o.pieceCacheEntries > 0 {
		t.model.cache = newPieceCache(o.pieceCacheEntries)
	}
	if err := t.setAddedTokens(mergeAdded(f.AddedTokens, o.extraAdded)); err != nil {
		return nil, err
	}
	if t.postBefore, t.postAfter, err = parsePostProcessor(f.PostProcessor); err != nil {
		return nil, err
	}
	if o.segmentCacheBytes > 0 {
		t.segments = newSegmentCache(o.segmentCacheBytes)
		// fastcache's chunks live outside the Go heap: hand them back to
		// its free list when the tokenizer goes away.
		runtime.AddCleanup(t, func(c *segmentCache) { c.reset() }, t.segments)
	}
	t.encoders.New = t.newEncoder
	t.wordCut = t.wordCutSafe()
	t.chatErr = errNoChatTemplate
	if o.chatTemplate != nil {
		t.chat, t.chatErr = compileChatTemplate(*o.chatTemplate)
	}
	return t, nil
}

// tokenID finds the id of a token's text: an added token, else the model's.
func (t *HF) tokenID(content string) (uint32, bool) {
	for _, m := range []*addedMatcher{t.added, t.addedNorm} {
		if m == nil {
			continue
		}
		for _, a := range m.tokens {
			if a.Content == content {
				return a.ID, true
			}
		}
	}
	if content == "" {
		return 0, false
	}
	v, ok := t.model.lookup(content)
	return v &^ selfMerging, ok
}

func (t *HF) newEncoder() any { return &encoder{t: t} }

// resetCaches empties every cache (benchmarks of cold encoding).
func (t *HF) resetCaches() {
	if t.model.cache != nil {
		t.model.cache = newPieceCache(t.model.cache.limit * len(t.model.cache.shards))
	}
	if t.segments != nil {
		t.segments.reset()
	}
	t.encoders = sync.Pool{New: t.newEncoder}
}

// mergeAdded adds the tokens of tokenizer_config.json's added_tokens_decoder
// that tokenizer.json lacks, as transformers does on load.
func mergeAdded(tokens, extra []addedToken) []addedToken {
	if len(extra) == 0 {
		return tokens
	}
	have := make(map[string]bool, len(tokens))
	for _, a := range tokens {
		have[a.Content] = true
	}
	for _, a := range extra {
		if !have[a.Content] {
			tokens = append(tokens, a)
			have[a.Content] = true
		}
	}
	return tokens
}

func (t *HF) setAddedTokens(tokens []addedToken) error {
	var raw, normed []addedToken
	for _, a := range tokens {
		if a.Normalized && t.normalize != nil {
			// HF matches these on normalized text, against their normalized
			// content.
			content, err := t.normalize.normalize(a.Content)
			if err != nil {
				return err
			}
			a.Content = content
			normed = append(normed, a)
		} else {
			raw = append(raw, a)
		}
	}
	t.added = newAddedMatcher(raw)
	t.addedNorm = newAddedMatcher(normed)
	return nil
}

// modelJSON is tokenizer.json's model, decoded in the same pass as the rest
// of the file; vocab and merges stay raw until the type is known.
type modelJSON struct {
	Type                    string          `json:"type"`
	Dropout                 *float64        `json:"dropout"`
	UnkToken                *string         `json:"unk_token"`
	ContinuingSubwordPrefix *string         `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string         `json:"end_of_word_suffix"`
	FuseUnk                 bool            `json:"fuse_unk"`
	ByteFallback            bool            `json:"byte_fallback"`
	IgnoreMerges            bool            `json:"ignore_merges"`
	RawVocab                json.RawMessage `json:"vocab"`
	Merges                  json.RawMessage `json:"merges"`
	Vocab                   map[string]uint32
}

func parseBPE(j modelJSON, byteLevel bool) (*bpeModel, error) {
	if j.Type == "" && j.Merges != nil {
		j.Type = "BPE" // untagged, as serde reads it
	}
	if j.Type != "BPE" {
		return nil, &UnsupportedError{"model", j.Type}
	}
	if err := json.Unmarshal(j.RawVocab, &j.Vocab); err != nil {
		return nil, fmt.Errorf("tokenize: model vocab: %w", err)
	}
	if j.Dropout != nil && *j.Dropout > 0 {
		return nil, &UnsupportedError{"model", "BPE with dropout (not deterministic)"}
	}
	m := &bpeModel{
		byteLevel:    byteLevel,
		byteFallback: j.ByteFallback,
		ignoreMerges: j.IgnoreMerges,
		fuseUnk:      j.FuseUnk,
		unk:          -1,
	}
	if j.ContinuingSubwordPrefix != nil {
		m.prefix = *j.ContinuingSubwordPrefix
	}
	if j.EndOfWordSuffix != nil {
		m.suffix = *j.EndOfWordSuffix
	}
	if byteLevel && (m.prefix != "" || m.suffix != "") {
		return nil, &UnsupportedError{"model", "byte-level BPE with continuing_subword_prefix or end_of_word_suffix"}
	}
	if j.UnkToken != nil {
		id, ok := j.Vocab[*j.UnkToken]
		if !ok {
			return nil, fmt.Errorf("tokenize: model: unk_token %q is not in the vocabulary", *j.UnkToken)
		}
		m.unk = int32(id)
	}
	for b := range m.fallbackIDs {
		m.fallbackIDs[b] = -1
		if id, ok := j.Vocab[fmt.Sprintf("<0x%02X>", b)]; ok {
			m.fallbackIDs[b] = int32(id)
		}
	}
	m.merges = newMergeTable(countMerges(j.Merges))
	var buf []byte
	err := eachMerge(j.Merges, func(rank int, left, right []byte) error {
		a, okA := j.Vocab[string(left)]
		b, okB := j.Vocab[string(right)]
		if !okA || !okB {
			return fmt.Errorf("tokenize: model: merge %d (%q %q) uses a token missing from the vocabulary", rank, left, right)
		}
		buf = append(append(buf[:0], left...), bytes.TrimPrefix(right, []byte(m.prefix))...)
		merged, ok := j.Vocab[string(buf)]
		if !ok {
			return fmt.Errorf("tokenize: model: merge %d (%q %q) makes a token missing from the vocabulary", rank, left, right)
		}
		m.merges.set(pairKey(a, b), uint64(rank)<<32|uint64(merged))
		return nil
	})
	if err != nil {
		return nil, err
	}
	m.vocab = j.Vocab
	if byteLevel {
		inv := make(map[rune]byte, 256)
		for b, r := range byteLevelRune {
			inv[r] = byte(b)
			m.byteIDs[b] = -1
			if id, ok := j.Vocab[string(r)]; ok {
				m.byteIDs[b] = int32(id)
			}
		}
		rawVocab := make(map[string]uint32, len(j.Vocab))
		for tok, id := range j.Vocab {
			if s, ok := byteLevelDecode(tok, inv); ok {
				rawVocab[s] = id
			}
		}
		m.vocab = rawVocab
	}
	for _, id := range m.vocab {
		if id&selfMerging != 0 {
			return nil, fmt.Errorf("tokenize: model: token id %d is out of range", id)
		}
	}
	if !m.ignoreMerges {
		m.markSelfMerging()
	}
	m.indexShort()
	m.checkSplitMeta()
	m.tokens, m.vocab = newVocabTable(m.vocab), nil
	return m, nil
}

// countMerges estimates the number of merges to size the table (which
// grows if the guess is short).
func countMerges(raw json.RawMessage) int {
	return bytes.Count(raw, []byte(`",`)) + 1
}

// eachMerge walks merges given as ["a b", ...] or [["a", "b"], ...] in
// already validated JSON, without building strings: most merge strings
// have no escapes and are handed over as slices of raw.
func eachMerge(raw json.RawMessage, fn func(rank int, a, b []byte) error) error {
	if isNull(raw) {
		return nil
	}
	p := mergeParser{data: raw}
	if !p.expect('[') {
		return p.fail()
	}
	for rank := 0; ; rank++ {
		p.space()
		if p.peek() == ']' {
			return nil
		}
		var a, b []byte
		var ok bool
		switch p.peek() {
		case '"':
			var s []byte
			if s, ok = p.str(); !ok {
				return p.fail()
			}
			k := bytes.IndexByte(s, ' ')
			if k < 0 {
				return fmt.Errorf("tokenize: merges: entry %d %q is not two tokens", rank, s)
			}
			a, b = s[:k], s[k+1:]
		case '[':
			p.pos++
			p.space()
			if a, ok = p.str(); !ok || !p.expect(',') {
				return p.fail()
			}
			p.space()
			if b, ok = p.str(); !ok || !p.expect(']') {
				return p.fail()
			}
		default:
			return p.fail()
		}
		if err := fn(rank, a, b); err != nil {
			return err
		}
		p.space()
		if p.peek() == ',' {
			p.pos++
		}
	}
}

type mergeParser struct {
	data []byte
	pos  int
}

func (p *mergeParser) space() {
	for p.pos < len(p.data) && (p.data[p.pos] == ' ' || p.data[p.pos] == '\n' || p.data[p.pos] == '\t' || p.data[p.pos] == '\r') {
		p.pos++
	}
}

func (p *mergeParser) peek() byte {
	if p.pos < len(p.data) {
		return p.data[p.pos]
	}
	return 0
}

func (p *mergeParser) expect(c byte) bool {
	p.space()
	if p.peek() != c {
		return false
	}
	p.pos++
	return true
}

func (p *mergeParser) fail() error {
	return fmt.Errorf("tokenize: merges: unexpected JSON at byte %d", p.pos)
}

// str reads a JSON string at pos; escaped ones go through encoding/json.
func (p *mergeParser) str() ([]byte, bool) {
	if p.peek() != '"' {
		return nil, false
	}
	start := p.pos
	escaped := false
	for i := start + 1; i < len(p.data); i++ {
		switch p.data[i] {
		case '\\':
			escaped = true
			i++
		case '"':
			p.pos = i + 1
			if !escaped {
				return p.data[start+1 : i], true
			}
			var s string
			if json.Unmarshal(p.data[start:i+1], &s) != nil {
				return nil, false
			}
			return []byte(s), true
		}
	}
	return nil, false
}

// parsePostProcessor returns the ids a single sequence gets before and
// after it when special tokens are requested.
func parsePostProcessor(raw json.RawMessage) (before, after []uint32, err error) {
	if isNull(raw) {
		return nil, nil, nil
	}
	var p struct {
		Type          string            `json:"type"`
		Processors    []json.RawMessage `json:"processors"`
		Single        json.RawMessage   `json:"single"`
		SpecialTokens map[string]struct {
			IDs []uint32 `json:"ids"`
		} `json:"special_tokens"`
		Cls []json.RawMessage `json:"cls"`
		Sep []json.RawMessage `json:"sep"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, nil, fmt.Errorf("tokenize: post_processor: %w", err)
	}
	switch p.Type {
	case "ByteLevel":
		return nil, nil, nil // offsets only
	case "Sequence":
		for _, r := range p.Processors {
			b, a, err := parsePostProcessor(r)
			if err != nil {
				return nil, nil, err
			}
			before = append(append([]uint32(nil), b...), before...)
			after = append(after, a...)
		}
		return before, after, nil
	case "RobertaProcessing", "BertProcessing":
		var cls, sep uint32
		if len(p.Cls) != 2 || len(p.Sep) != 2 ||
			json.Unmarshal(p.Cls[1], &cls) != nil || json.Unmarshal(p.Sep[1], &sep) != nil {
			return nil, nil, fmt.Errorf("tokenize: post_processor %s: bad cls/sep", p.Type)
		}
		return []uint32{cls}, []uint32{sep}, nil
	case "TemplateProcessing":
		items, err := templateItems(p.Single)
		if err != nil {
			return nil, nil, err
		}
		seen := false
		for _, it := range items {
			if it.sequence {
				if it.id != "A" || seen {
					return nil, nil, &UnsupportedError{"post_processor", "TemplateProcessing single with sequence " + it.id}
				}
				seen = true
				continue
			}
			st, ok := p.SpecialTokens[it.id]
			if !ok {
				return nil, nil, fmt.Errorf("tokenize: post_processor: special token %q has no ids", it.id)
			}
			if seen {
				after = append(after, st.IDs...)
			} else {
				before = append(before, st.IDs...)
			}
		}
		if !seen {
			return nil, nil, &UnsupportedError{"post_processor", "TemplateProcessing single without $A"}
		}
		return before, after, nil
	}
	return nil, nil, &UnsupportedError{"post_processor", p.Type}
}

type templateItem struct {
	sequence bool
	id       string
}

// templateItems reads TemplateProcessing's single template, as a list of
// {"SpecialToken"|"Sequence": {"id": ...}} or as a string like "<s> $A".
func templateItems(raw json.RawMessage) ([]templateItem, error) {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		var items []templateItem
		for _, f := range strings.Fields(s) {
			if name, ok := strings.CutPrefix(f, "$"); ok {
				name, _, _ = strings.Cut(name, ":")
				if name == "" || name == "0" {
					name = "A"
				}
				items = append(items, templateItem{true, name})
				continue
			}
			name, _, _ := strings.Cut(f, ":")
			items = append(items, templateItem{false, name})
		}
		return items, nil
	}
	var list []struct {
		SpecialToken *struct {
			ID string `json:"id"`
		} `json:"SpecialToken"`
		Sequence *struct {
			ID string `json:"id"`
		} `json:"Sequence"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, fmt.Errorf("tokenize: post_processor single: %w", err)
	}
	items := make([]templateItem, 0, len(list))
	for _, it := range list {
		switch {
		case it.Sequence != nil:
			items = append(items, templateItem{true, it.Sequence.ID})
		case it.SpecialToken != nil:
			items = append(items, templateItem{false, it.SpecialToken.ID})
		}
	}
	return items, nil
}

// ---- encoding ----

// encoder is the per-call state of one encode, pooled.
type encoder struct {
	t      *HF
	out    []uint32
	err    error
	sc     bpeScratch
	spans  []addedSpan
	spans2 []addedSpan
	cached []byte // segment-cache scratch
}

// maxPooledScratch bounds the scratch an idle encoder keeps: one huge
// piece must not pin tens of MB in the pool.
const maxPooledScratch = 1 << 16

func (e *encoder) release() {
	if cap(e.sc.syms) > maxPooledScratch {
		e.sc.syms = nil
	}
	if cap(e.sc.heap) > maxPooledScratch {
		e.sc.heap = nil
	}
	if cap(e.spans) > maxPooledScratch {
		e.spans = nil
	}
	if cap(e.spans2) > maxPooledScratch {
		e.spans2 = nil
	}
	if cap(e.cached) > 4*maxPooledScratch {
		e.cached = nil
	}
}

// emit hands piece s to pre-tokenizer stage next, or to the model after the
// last stage. It reports whether to go on (no error occurred).
func (e *encoder) emit(next int, s string, first bool) bool {
	if next < len(e.t.pre) {
		return e.t.pre[next].pretokenize(e, s, first, next+1)
	}
	e.out = e.t.model.appendPieces(e.out, s, &e.sc)
	return true
}

// emitSpans splits s with a pattern and behaviour and emits the pieces.
func (e *encoder) emitSpans(next int, s string, first bool, p pattern, b behavior, invert bool) bool {
	if s == "" {
		return true
	}
	spans, err := p.spans(s, nil)
	if err != nil {
		e.err = err
		return false
	}
	for _, sp := range applyBehavior(spans, b, invert) {
		if !sp.match || sp.start == sp.end {
			continue
		}
		if !e.emit(next, s[sp.start:sp.end], first && sp.start == 0) {
			return false
		}
	}
	return true
}

// Encode implements Model.
func (t *HF) Encode(text string, addSpecialTokens bool) ([]uint32, error) {
	return t.AppendEncode(make([]uint32, 0, len(text)/3+4), text, addSpecialTokens)
}

// AppendEncode appends the ids of text to dst. With a segment cache and
// enough room in dst, re-encoding known text does not allocate.
func (t *HF) AppendEncode(dst []uint32, text string, addSpecialTokens bool) ([]uint32, error) {
	if !utf8.ValidString(text) {
		return dst, ErrInvalidUTF8
	}
	e := t.encoders.Get().(*encoder)
	e.out, e.err = dst, nil
	if addSpecialTokens {
		e.out = append(e.out, t.postBefore...)
	}
	complete := true
	if t.added == nil {
		complete = t.segment(e, text, true)
	} else {
		e.spans = t.added.split(text, e.spans[:0])
		for _, sp := range e.spans {
			if sp.tok >= 0 {
				e.out = append(e.out, t.added.tokens[sp.tok].ID)
				continue
			}
			if !t.segment(e, text[sp.start:sp.end], sp.start == 0) {
				complete = false
				break
			}
		}
	}
	if addSpecialTokens && complete {
		e.out = append(e.out, t.postAfter...)
	}
	out, err := e.out, e.err
	e.out = nil
	e.release()
	t.encoders.Put(e)
	if err != nil {
		return dst, err
	}
	return out, nil
}

// minCachedSegment: shorter segments tokenize faster than a cache lookup
// pays for.
const minCachedSegment = 16

// segment encodes text between added tokens, through the segment cache. It
// reports false when an error occurred.
func (t *HF) segment(e *encoder, seg string, first bool) bool {
	if seg == "" {
		return true
	}
	cache := t.segments
	if cache == nil || len(seg) < minCachedSegment {
		return t.segmentUncached(e, seg, first)
	}
	out, buf, ok := cache.appendTo(e.out, e.cached, seg, first)
	e.cached = buf
	if ok {
		e.out = out
		return true
	}
	t.segmentMisses.Add(1)
	mark := len(e.out)
	if !t.segmentUncached(e, seg, first) {
		return false
	}
	e.cached = cache.put(e.cached, seg, first, e.out[mark:])
	return true
}

func (t *HF) segmentUncached(e *encoder, seg string, first bool) bool {
	s := seg
	if t.normalize != nil {
		var err error
		if s, err = t.normalize.normalize(seg); err != nil {
			e.err = err
			return false
		}
	}
	if t.addedNorm == nil {
		return e.emit(0, s, first)
	}
	e.spans2 = t.addedNorm.split(s, e.spans2[:0])
	for _, sp := range e.spans2 {
		if sp.tok >= 0 {
			e.out = append(e.out, t.addedNorm.tokens[sp.tok].ID)
			continue
		}
		if !e.emit(0, s[sp.start:sp.end], first && sp.start == 0) {
			return false
		}
	}
	return true
}
