package tokenize

import (
	"errors"
	"strings"

	"github.com/kvmesh/kvmesh/chattemplate"
)

// DefaultMaxPrefixTokens is how many leading tokens routing looks at unless
// configured otherwise (max_prefix_tokens).
const DefaultMaxPrefixTokens = 16384

// DefaultMaxPrefixBytes bounds the prompt bytes EncodePrefix and
// EncodeChatPrefix render and tokenize unless configured otherwise
// (max_prefix_bytes): 64 bytes for each of the default max_prefix_tokens,
// eight times what a token of prose takes, and a few milliseconds of work.
const DefaultMaxPrefixBytes = 1 << 20

// windowBytesPerToken sizes the first window of a prompt tokenized: about
// twice what a token of prose takes, so one window mostly suffices.
const windowBytesPerToken = 8

// ErrPromptTooLong is EncodePrefix's and EncodeChatPrefix's answer for a
// prompt whose leading tokens cannot be found within max_prefix_bytes: one
// with no word end there (a single huge word), a chat whose template is not
// known to render in order, or a tokenizer that cannot cut, beyond that
// size. Such a request is routed by load alone.
var ErrPromptTooLong = errors.New("tokenize: prompt too long to find its prefix within max_prefix_bytes")

// Bounds are what routing looks at of a prompt.
type Bounds struct {
	// MaxTokens is how many leading ids are wanted (0:
	// DefaultMaxPrefixTokens).
	MaxTokens int
	// MaxBytes bounds the prompt bytes rendered and tokenized (0:
	// DefaultMaxPrefixBytes).
	MaxBytes int
}

func (b Bounds) withDefaults() Bounds {
	if b.MaxTokens <= 0 {
		b.MaxTokens = DefaultMaxPrefixTokens
	}
	if b.MaxBytes <= 0 {
		b.MaxBytes = DefaultMaxPrefixBytes
	}
	return b
}

// firstWindow is the prompt bytes tokenized first.
func (b Bounds) firstWindow() int { return min(b.MaxTokens*windowBytesPerToken, b.MaxBytes) }

// Prefixed is what routing learns of a prompt.
type Prefixed struct {
	// IDs are the prompt's leading ids, at most MaxTokens, exactly as the
	// whole prompt's; fewer than MaxTokens of a longer prompt when its
	// first MaxBytes held no more.
	IDs []uint32
	// Total is the prompt's token count: exact unless Estimated, when only
	// a window of the prompt was tokenized and the rest is counted at the
	// window's ids per byte.
	Total     int
	Estimated bool
}

// wordCutter is implemented by models for which the ids of a text cut at a
// word end (wordEnd) are the leading ids of the whole text.
type wordCutter interface {
	cutsAtWords() bool
	// encodeCut encodes a text cut at a word end: as Encode, without the
	// ids a post-processor appends at the end.
	encodeCut(dst []uint32, text string, addSpecialTokens bool) ([]uint32, error)
}

// chatCutter is implemented by models that can render a chat's prompt
// apart from tokenizing it.
type chatCutter interface {
	wordCutter
	renderChat(chat Chat) (string, error)
	// rendersInOrder: chattemplate.CutMessages's cut renders as the
	// whole chat does up to the marker.
	rendersInOrder() bool
}

// EncodePrefix returns the leading ids of text (as m.Encode gives them) and
// its token count, tokenizing no more than b.MaxBytes of it. A prompt
// longer than the first window is cut at a word end, whose leading ids are
// the whole prompt's, for tokenizers where that holds (HF with a known
// pre-tokenizer, Builtin; see wordCutSafe); the window grows fourfold
// until it holds b.MaxTokens ids or reaches b.MaxBytes. Other tokenizers
// encode prompts up to b.MaxBytes whole and refuse longer ones with
// ErrPromptTooLong, as does a prompt with no word end where it must be cut.
func EncodePrefix(m Model, text string, addSpecialTokens bool, b Bounds) (Prefixed, error) {
	return encodePrefix(m, nil, text, addSpecialTokens, b.withDefaults())
}

func encodePrefix(m Model, dst []uint32, text string, addSpecialTokens bool, b Bounds) (Prefixed, error) {
	wc, ok := m.(wordCutter)
	if !ok || !wc.cutsAtWords() {
		if len(text) > b.MaxBytes {
			return Prefixed{}, ErrPromptTooLong
		}
		ids, err := m.Encode(text, addSpecialTokens)
		return Prefixed{IDs: truncate(ids, b.MaxTokens), Total: len(ids)}, err
	}
	for window := b.firstWindow(); ; window = min(window*4, b.MaxBytes) {
		if len(text) <= window {
			ids, err := m.Encode(text, addSpecialTokens)
			return Prefixed{IDs: truncate(ids, b.MaxTokens), Total: len(ids)}, err
		}
		p := wordEnd(text, window)
		if p == 0 && window < b.MaxBytes {
			continue
		}
		if p == 0 {
			return Prefixed{}, ErrPromptTooLong
		}
		ids, err := wc.encodeCut(dst, text[:p], addSpecialTokens)
		if err != nil {
			return Prefixed{}, err
		}
		if len(ids) >= b.MaxTokens || window >= b.MaxBytes {
			return estimated(ids, b.MaxTokens, len(text), p), nil
		}
		dst = ids[:0]
	}
}

// estimated is the answer for ids of the first used of size bytes: the
// rest is counted at their ids per byte.
func estimated(ids []uint32, maxTokens, size, used int) Prefixed {
	total := int(int64(len(ids)) * int64(size) / int64(max(used, 1)))
	return Prefixed{IDs: truncate(ids, maxTokens), Total: max(total, len(ids)), Estimated: true}
}

// EncodeChatPrefix returns the leading ids of a chat's prompt (as
// m.EncodeChat gives them) and its token count, rendering and tokenizing no
// more than about b.MaxBytes of it. A chat longer than the first window
// whose template renders in order (chattemplate.Template.RendersInOrder,
// Builtin) renders only its leading messages, the last one cut after a word
// (chattemplate.CutMessages), and the window grows fourfold until it holds
// b.MaxTokens ids or reaches b.MaxBytes. Other chats of up to b.MaxBytes
// render whole and their prompt is tokenized as EncodePrefix does; longer
// ones get ErrPromptTooLong. The prompt is not returned.
func EncodeChatPrefix(m Model, chat Chat, b Bounds) (Prefixed, error) {
	b = b.withDefaults()
	size := len(chat.Messages) + len(chat.Tools) + len(chat.TemplateKwargs)
	cc, ok := m.(chatCutter)
	inOrder := ok && cc.cutsAtWords() && cc.rendersInOrder() && len(chat.TemplateKwargs) == 0
	if size > b.firstWindow() && !inOrder {
		if size > b.MaxBytes {
			return Prefixed{}, ErrPromptTooLong
		}
		if ok && cc.cutsAtWords() {
			prompt, err := cc.renderChat(chat)
			if err != nil {
				return Prefixed{}, err
			}
			return encodePrefix(m, chat.IDs, prompt, chat.AddSpecialTokens, b)
		}
	}
	if size <= b.firstWindow() || !inOrder {
		_, ids, err := m.EncodeChat(chat)
		return Prefixed{IDs: truncate(ids, b.MaxTokens), Total: len(ids)}, err
	}
	other := len(chat.Tools) + len(chat.TemplateKwargs)
	for window := b.firstWindow(); ; window = min(window*4, b.MaxBytes) {
		if size <= window {
			_, ids, err := m.EncodeChat(chat)
			return Prefixed{IDs: truncate(ids, b.MaxTokens), Total: len(ids)}, err
		}
		cut, kept, ok := chattemplate.CutMessages(chat.Messages, window-other)
		if !ok && window < b.MaxBytes {
			continue
		}
		if !ok {
			return Prefixed{}, ErrPromptTooLong
		}
		lead := chat
		lead.Messages, lead.AddGenerationPrompt, lead.ContinueFinalMessage = cut, false, false
		prompt, err := cc.renderChat(lead)
		if err != nil {
			return Prefixed{}, err
		}
		end := strings.LastIndex(prompt, chattemplate.CutMarker)
		if end < 0 {
			return Prefixed{}, errors.New("tokenize: the chat template dropped the cut marker")
		}
		ids, err := cc.encodeCut(chat.IDs, prompt[:end], chat.AddSpecialTokens)
		if err != nil {
			return Prefixed{}, err
		}
		if len(ids) >= b.MaxTokens || window >= b.MaxBytes {
			return estimated(ids, b.MaxTokens, len(chat.Messages), kept), nil
		}
		chat.IDs = ids[:0]
	}
}

func truncate(ids []uint32, n int) []uint32 {
	if len(ids) > n {
		return ids[:n]
	}
	return ids
}
