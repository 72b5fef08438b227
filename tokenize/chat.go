package tokenize

import (
	"errors"

	"github.com/kvmesh/kvmesh/chattemplate"
)

// errNoChatTemplate is what EncodeChat returns for a tokenizer loaded
// without a chat template (Load, or a directory that has none).
var errNoChatTemplate = errors.New("tokenize: no chat template loaded (use LoadDir on a model directory with one)")

// MediaMessage reports whether err is EncodeChat's answer to a chat holding
// media content (an image, audio, a video...), and the index of the first
// message that holds some. The engine's processor turns media into tokens
// the router cannot know, and keys the blocks holding them by the media's
// hash; the messages before that one still render and tokenize as the
// engine does them.
func MediaMessage(err error) (int, bool) {
	var ie *chattemplate.InputError
	if errors.As(err, &ie) && ie.Media {
		return ie.Message, true
	}
	return 0, false
}

// chatRenderer is the seam to package chattemplate.
type chatRenderer interface {
	RenderInto(*[]byte, chattemplate.Input) (string, error)
	Renderer() string
	RendersInOrder() bool
}

func compileChatTemplate(src string) (chatRenderer, error) {
	t, err := chattemplate.Compile(src)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// WithChatTemplate renders chats with template source src instead of the
// directory's own template.
func WithChatTemplate(src string) Option {
	return func(o *options) { o.chatTemplate = &src }
}

// ChatRenderer names how chats render: "native llama3" and the like for
// templates package chattemplate renders in Go, "jinja" for the rest, ""
// without a chat template.
func (t *HF) ChatRenderer() string {
	if t.chat == nil {
		return ""
	}
	return t.chat.Renderer()
}

// RenderChat renders a chat with the model's template, as transformers'
// apply_chat_template(tokenize=False) does.
func (t *HF) RenderChat(chat Chat) (string, error) {
	return t.renderWith(t.chat, chat)
}

func (t *HF) renderWith(r chatRenderer, chat Chat) (string, error) {
	if r == nil {
		return "", t.chatErr
	}
	buf := chat.Prompt // the prompt shares its memory, as Chat documents
	if buf == nil {
		buf = new([]byte)
	}
	return r.RenderInto(buf, chattemplate.Input{
		Messages:             chat.Messages,
		Tools:                chat.Tools,
		Kwargs:               chat.TemplateKwargs,
		AddGenerationPrompt:  chat.AddGenerationPrompt,
		ContinueFinalMessage: chat.ContinueFinalMessage,
		BOSToken:             t.bosToken,
		EOSToken:             t.eosToken,
	})
}

// EncodeChat implements Model: render the template, then tokenize without
// adding special tokens (vLLM's chat path; BOS comes from the template).
func (t *HF) EncodeChat(chat Chat) (string, []uint32, error) {
	return t.encodeChat(t.chat, chat)
}

func (t *HF) encodeChat(r chatRenderer, chat Chat) (string, []uint32, error) {
	prompt, err := t.renderWith(r, chat)
	if err != nil {
		return "", nil, err
	}
	buf := chat.IDs[:0]
	if size := len(prompt)/3 + 4; cap(buf) < size {
		buf = make([]uint32, 0, size)
	}
	ids, err := t.AppendEncode(buf, prompt, chat.AddSpecialTokens)
	if err != nil {
		return prompt, nil, err
	}
	return prompt, ids, nil
}

func (t *HF) cutsAtWords() bool { return t.wordCut }

func (t *HF) rendersInOrder() bool { return t.chat != nil && t.chat.RendersInOrder() }

func (t *HF) renderChat(chat Chat) (string, error) { return t.RenderChat(chat) }

func (t *HF) encodeCut(dst []uint32, text string, addSpecialTokens bool) ([]uint32, error) {
	if cap(dst) == 0 {
		dst = make([]uint32, 0, len(text)/3+4)
	}
	ids, err := t.AppendEncode(dst[:0], text, addSpecialTokens)
	if err == nil && addSpecialTokens {
		ids = ids[:len(ids)-len(t.postAfter)] // a cut text has no end
	}
	return ids, err
}
