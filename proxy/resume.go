package proxy

import (
	"bytes"
	"encoding/json"
)

// A stream that breaks after the client has seen part of the answer (the
// engine died, or stalled past the idle timeout) can go on at the next
// target when the request allows it (Request.Resume): that target is asked
// to continue the text relayed so far (an assistant prefix for chats, the
// prompt plus the text for completions), and its events are relayed after
// the ones the client already has. A transcript follows the stream to know
// that text and whether a continuation can carry everything the client saw.

// transcript is what one choice of a chat or completions stream has sent.
type transcript struct {
	text   []byte
	chunks int // events that carried text: at most one token each
	// lost is set once the stream showed something a continuation cannot
	// carry on from: several choices, tool calls, reasoning, or an event it
	// cannot read.
	lost bool
	// finished is set by a finish reason: the answer is complete, nothing
	// is left to continue.
	finished bool
	// lead is set while relaying a continuation: its first events (the
	// role announcement, empty text) are dropped, the client had them.
	lead bool
	// id and created are the stream's as the client first saw them; a
	// continuation's events carry their own (contID, contCreated),
	// rewritten on the way.
	id, contID           string
	created, contCreated []byte
	continued            bool
}

// continuing readies t for relaying a continuation.
func (t *transcript) continuing() {
	t.lead, t.continued, t.contID, t.contCreated = true, true, "", nil
}

// sameID returns ev with a continuation's id and created time replaced by
// the stream's own, so the client sees one stream.
func (t *transcript) sameID(ev []byte) []byte {
	if !t.continued {
		return ev
	}
	if t.contID != "" && t.id != "" && t.contID != t.id {
		ev = bytes.Replace(ev, []byte(`"id":"`+t.contID+`"`), []byte(`"id":"`+t.id+`"`), 1)
	}
	if len(t.contCreated) > 0 && len(t.created) > 0 && !bytes.Equal(t.contCreated, t.created) {
		ev = bytes.Replace(ev, append([]byte(`"created":`), t.contCreated...), append([]byte(`"created":`), t.created...), 1)
	}
	return ev
}

// streamChunk is the part of a chat.completion.chunk or text_completion
// chunk a transcript reads.
type streamChunk struct {
	ID      string          `json:"id"`
	Created json.RawMessage `json:"created"`
	Choices []struct {
		Index int     `json:"index"`
		Text  *string `json:"text"`
		Delta *struct {
			Content          *string         `json:"content"`
			ReasoningContent *string         `json:"reasoning_content"`
			Reasoning        *string         `json:"reasoning"`
			ToolCalls        json.RawMessage `json:"tool_calls"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
}

// note reads one data payload (not [DONE]) and reports whether it is to be
// relayed: false only for a continuation's lead events.
func (t *transcript) note(payload []byte) bool {
	if t.lost {
		return true
	}
	var c streamChunk
	if err := json.Unmarshal(payload, &c); err != nil {
		t.lost = true
		return true
	}
	switch {
	case !t.continued && t.id == "":
		t.id, t.created = c.ID, bytes.Clone(c.Created)
	case t.continued && t.contID == "":
		t.contID, t.contCreated = c.ID, bytes.Clone(c.Created)
	}
	if c.Choices == nil {
		t.lost = true // not a chunk: an error event, say
		return true
	}
	if len(c.Choices) == 0 {
		return true // a usage-only chunk
	}
	if len(c.Choices) > 1 || c.Choices[0].Index != 0 {
		t.lost = true
		return true
	}
	ch := c.Choices[0]
	var text *string
	if ch.Delta != nil {
		d := ch.Delta
		if nonEmpty(d.ReasoningContent) || nonEmpty(d.Reasoning) || len(d.ToolCalls) > 0 && !bytes.Equal(d.ToolCalls, []byte("null")) && !bytes.Equal(d.ToolCalls, []byte("[]")) {
			t.lost = true
			return true
		}
		text = d.Content
	} else {
		text = ch.Text
	}
	if ch.FinishReason != nil {
		t.finished = true
	}
	if !nonEmpty(text) {
		return !t.lead || ch.FinishReason != nil
	}
	t.lead = false
	t.text = append(t.text, *text...)
	t.chunks++
	return true
}

func nonEmpty(s *string) bool { return s != nil && *s != "" }

// resumable reports whether the stream can be continued elsewhere: the
// client saw nothing a continuation would drop (maybe no text at all yet)
// and the answer is not complete.
func (t *transcript) resumable() bool { return t != nil && !t.lost && !t.finished }
