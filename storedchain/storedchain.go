// Package storedchain lets a router predict the prompt of a Responses
// follow-up (previous_response_id), which the engine builds from a stored
// history the router never sees. vLLM (construct_input_messages in
// vllm/entrypoints/openai/responses/utils.py, 01ca842d; _make_request in
// responses/serving.py, 0001948b) renders the follow-up from the
// request's instructions, the stored response's messages less their system
// messages, one assistant message per text part of its output messages
// (reasoning and function calls are left out), then the new input.
//
// The router that relays a response computes, from the prompt it already
// tokenized, the chained block keys (package blockkey) of the conversation
// as the engine will render it for the next turn: the history up to that
// request's input, without the generation prompt. The id the client is
// given carries that chain's end (package storedid): the key of its last
// full block, the tokens after it, its length, and a fingerprint of what
// the rendering depended on beside the messages (the instructions, the
// tools, the template arguments and the key seed). The router that gets
// the follow-up reads the stored output from the replica that holds it
// (GET /v1/responses/{id}) and renders what comes after the history: the
// output's assistant messages and the new input, behind a stand-in for the
// history. Those tokens continue the chain, so the replica's filter tells
// how much of the follow-up's prompt it holds, as for any request.
//
// Limits. The rendering after the history must not depend on the history
// itself: true of chat templates that render each message on its own
// between special tokens (ChatML, Llama 3), checked on the stand-in, which
// catches templates that join consecutive tool messages when the history
// ends with one and the follow-up starts with another. A follow-up whose
// instructions, tools or template arguments differ from its predecessor's,
// a history with a system message besides the instructions, a history that
// ends with an assistant message, or a replica whose filter no longer holds
// the history's last block get no continued prediction (the router
// predicts no cached tokens for them, as before). A block of the history
// is taken to be resident when its last block is, as a chained key says.
package storedchain

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/cespare/xxhash/v2"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/tokenize"
)

// MaxBlockSize bounds the block size a state is kept for: the tokens after
// the last full block travel in the id.
const MaxBlockSize = 32

// maxTokens bounds a state's length, far past any model's context.
const maxTokens = 1 << 24

// version is the first byte of an encoded State.
const version = 1

// Role is the role of a history's last message, which decides how the
// stand-in for the history ends.
type Role byte

// The roles a history may end with.
const (
	User Role = 'u'
	Tool Role = 't'
)

// State is the end of a conversation's block-key chain as the engine
// renders it for the next turn.
type State struct {
	// Fingerprint is of what the rendering depended on beside the
	// messages (Fingerprint).
	Fingerprint uint64
	LastRole    Role
	// BlockSize keys the chain; Tokens counts its tokens; Last is the key
	// of its last full block (0 when there is none) and Tail the tokens
	// after it.
	BlockSize, Tokens int
	Last              uint64
	Tail              []uint32
}

// Blocks counts the state's full blocks.
func (s *State) Blocks() int { return s.Tokens / s.BlockSize }

// Encode returns s as the bytes an id carries (at most
// 19 + 5·(MaxBlockSize-1) bytes).
func (s *State) Encode() []byte {
	b := []byte{version}
	b = binary.LittleEndian.AppendUint64(b, s.Fingerprint)
	b = append(b, byte(s.LastRole))
	b = binary.AppendUvarint(b, uint64(s.BlockSize))
	b = binary.AppendUvarint(b, uint64(s.Tokens))
	if s.Blocks() > 0 {
		b = binary.LittleEndian.AppendUint64(b, s.Last)
	}
	for _, t := range s.Tail {
		b = binary.AppendUvarint(b, uint64(t))
	}
	return b
}

// ErrState reports bytes that are no State Encode made.
var ErrState = errors.New("storedchain: not a conversation state")

// Decode reads a State from b, outside input (it came back in an id a
// client sent).
func Decode(b []byte) (State, error) {
	var s State
	if len(b) < 10 || b[0] != version {
		return s, ErrState
	}
	s.Fingerprint = binary.LittleEndian.Uint64(b[1:])
	s.LastRole = Role(b[9])
	if s.LastRole != User && s.LastRole != Tool {
		return s, ErrState
	}
	b = b[10:]
	bs, n := binary.Uvarint(b)
	if n <= 0 || bs == 0 || bs > MaxBlockSize {
		return s, ErrState
	}
	b = b[n:]
	total, n := binary.Uvarint(b)
	if n <= 0 || total > maxTokens {
		return s, ErrState
	}
	b = b[n:]
	s.BlockSize, s.Tokens = int(bs), int(total)
	if s.Blocks() > 0 {
		if len(b) < 8 {
			return s, ErrState
		}
		s.Last, b = binary.LittleEndian.Uint64(b), b[8:]
	}
	tail := s.Tokens % s.BlockSize
	s.Tail = make([]uint32, 0, tail)
	for range tail {
		t, n := binary.Uvarint(b)
		if n <= 0 || t > 1<<32-1 {
			return s, ErrState
		}
		s.Tail, b = append(s.Tail, uint32(t)), b[n:]
	}
	if len(b) != 0 {
		return s, ErrState
	}
	return s, nil
}

// extend returns s continued by tokens.
func (s State) extend(tokens []uint32) State {
	all := append(append(make([]uint32, 0, len(s.Tail)+len(tokens)), s.Tail...), tokens...)
	full := len(all) / s.BlockSize * s.BlockSize
	for i := 0; i < full; i += s.BlockSize {
		s.Last = blockkey.Next(s.Last, all[i:i+s.BlockSize])
	}
	s.Tail = all[full:]
	s.Tokens += len(tokens)
	return s
}

// Fingerprint hashes what a Responses request's rendering depends on
// beside its history and input: its instructions (the leading system
// message), tools and template arguments, and the key seed.
func Fingerprint(r *request.Request, seed uint64) uint64 {
	lead, _, _ := split(r.Messages)
	var d xxhash.Digest
	d.ResetWithSeed(seed)
	for _, part := range [][]byte{lead, r.Tools, r.ChatTemplateKwargs} {
		_, _ = d.Write(binary.LittleEndian.AppendUint64(nil, uint64(len(part))))
		_, _ = d.Write(part)
	}
	return d.Sum64()
}

// Begin returns the state after r, a stored Responses request that
// continues none, whose whole prompt (with the generation prompt) is
// prompt.
func Begin(tk tokenize.Model, r *request.Request, seed uint64, prompt []uint32, bs int) (State, error) {
	if err := renderable(r, bs); err != nil {
		return State{}, err
	}
	_, msgs, err := split(r.Messages)
	if err != nil {
		return State{}, err
	}
	last, err := lastRole(msgs)
	if err != nil {
		return State{}, err
	}
	gen, err := generationPrompt(tk, r)
	if err != nil {
		return State{}, err
	}
	if !hasSuffix(prompt, gen) {
		return State{}, errors.New("storedchain: the prompt does not end with the generation prompt")
	}
	s := State{Fingerprint: Fingerprint(r, seed), LastRole: last, BlockSize: bs, Last: seed}
	s = s.extend(prompt[:len(prompt)-len(gen)])
	if s.Blocks() == 0 {
		s.Last = 0
	}
	return s, nil
}

// Continued is a follow-up's prompt as the router knows it: Blocks full
// blocks of the stored history, the last with key Last (0 for none), then
// IDs, the tail of the history and the tokens after it.
type Continued struct {
	BlockSize, Blocks int
	Last              uint64
	IDs               []uint32
}

// Tokens counts the prompt's tokens.
func (c *Continued) Tokens() int { return c.Blocks*c.BlockSize + len(c.IDs) }

// Continue returns the prompt of r, a follow-up of the response st was
// carried by, whose output messages' text parts are outputs, and the state
// after r. seed and bs are r's key seed and its replica's block size.
func Continue(tk tokenize.Model, r *request.Request, seed uint64, st State, outputs []string, bs int) (Continued, State, error) {
	if err := renderable(r, bs); err != nil {
		return Continued{}, State{}, err
	}
	if st.BlockSize != bs {
		return Continued{}, State{}, fmt.Errorf("storedchain: the history was keyed by %d-token blocks, the replica has %d", st.BlockSize, bs)
	}
	if Fingerprint(r, seed) != st.Fingerprint {
		return Continued{}, State{}, errors.New("storedchain: the instructions, tools or template arguments differ from the stored response's")
	}
	lead, input, err := split(r.Messages)
	if err != nil {
		return Continued{}, State{}, err
	}
	after := make([]json.RawMessage, 0, len(outputs)+len(input))
	for _, o := range outputs {
		m, err := json.Marshal(map[string]string{"role": "assistant", "content": o})
		if err != nil {
			return Continued{}, State{}, err
		}
		after = append(after, m)
	}
	after = append(after, input...)
	last, err := lastRole(after)
	if err != nil {
		return Continued{}, State{}, err
	}
	history := standIn(lead, st.LastRole)
	chat := tokenize.Chat{Messages: join(history), Tools: r.Tools, TemplateKwargs: r.ChatTemplateKwargs}
	_, before, err := tk.EncodeChat(chat)
	if err != nil {
		return Continued{}, State{}, err
	}
	chat.Messages = join(append(history, after...))
	_, closed, err := tk.EncodeChat(chat)
	if err != nil {
		return Continued{}, State{}, err
	}
	chat.AddGenerationPrompt = true
	_, prompt, err := tk.EncodeChat(chat)
	if err != nil {
		return Continued{}, State{}, err
	}
	if !hasPrefix(closed, before) || !hasPrefix(prompt, closed) {
		return Continued{}, State{}, errors.New("storedchain: the template renders what follows the history differently after another history")
	}
	c := Continued{BlockSize: bs, Blocks: st.Blocks(), Last: st.Last,
		IDs: append(append([]uint32(nil), st.Tail...), prompt[len(before):]...)}
	if c.Blocks == 0 {
		c.Last = 0
	}
	next := st
	if next.Blocks() == 0 {
		next.Last = seed
	}
	next = next.extend(closed[len(before):])
	next.LastRole = last
	if next.Blocks() == 0 {
		next.Last = 0
	}
	return c, next, nil
}

// renderable checks what Begin and Continue need of r.
func renderable(r *request.Request, bs int) error {
	switch {
	case r.Kind != request.Responses || r.Unconvertible != nil:
		return errors.New("storedchain: not a Responses request the router renders")
	case bs <= 0 || bs > MaxBlockSize:
		return fmt.Errorf("storedchain: block size %d is not kept", bs)
	case r.AddGenerationPrompt != nil && !*r.AddGenerationPrompt, r.ContinueFinalMessage != nil && *r.ContinueFinalMessage:
		return errors.New("storedchain: the request continues its last message")
	}
	return nil
}

// split returns the leading system message of msgs (the instructions, nil
// for none) and the messages after it, none of which may be a system
// message: vLLM leaves those out of the history it stores.
func split(msgs json.RawMessage) (lead json.RawMessage, rest []json.RawMessage, err error) {
	if err := json.Unmarshal(msgs, &rest); err != nil {
		return nil, nil, err
	}
	if len(rest) > 0 && roleOf(rest[0]) == "system" {
		lead, rest = rest[0], rest[1:]
	}
	for _, m := range rest {
		if roleOf(m) == "system" {
			return nil, nil, errors.New("storedchain: a system message the follow-up will not see")
		}
	}
	return lead, rest, nil
}

func roleOf(m json.RawMessage) string {
	var v struct {
		Role string `json:"role"`
	}
	_ = json.Unmarshal(m, &v)
	return v.Role
}

// lastRole is the role msgs end with, which must be one a history may
// end with.
func lastRole(msgs []json.RawMessage) (Role, error) {
	if len(msgs) == 0 {
		return 0, errors.New("storedchain: no input")
	}
	switch roleOf(msgs[len(msgs)-1]) {
	case "user":
		return User, nil
	case "tool":
		return Tool, nil
	}
	return 0, errors.New("storedchain: the history ends with neither a user nor a tool message")
}

// standIn is a history of one message ending as the real one does, after
// the instructions.
func standIn(lead json.RawMessage, last Role) []json.RawMessage {
	var h []json.RawMessage
	if lead != nil {
		h = append(h, lead)
	}
	if last == Tool {
		return append(h, json.RawMessage(`{"role":"tool","content":"-","tool_call_id":"call_0"}`))
	}
	return append(h, json.RawMessage(`{"role":"user","content":"-"}`))
}

// generationPrompt returns the tokens the template appends for
// add_generation_prompt, found on a stand-in chat with r's tools and
// template arguments.
func generationPrompt(tk tokenize.Model, r *request.Request) ([]uint32, error) {
	chat := tokenize.Chat{Messages: json.RawMessage(`[{"role":"user","content":"-"}]`), Tools: r.Tools, TemplateKwargs: r.ChatTemplateKwargs}
	_, closed, err := tk.EncodeChat(chat)
	if err != nil {
		return nil, err
	}
	chat.AddGenerationPrompt = true
	_, open, err := tk.EncodeChat(chat)
	if err != nil {
		return nil, err
	}
	if !hasPrefix(open, closed) {
		return nil, errors.New("storedchain: the generation prompt does not follow the closed chat")
	}
	return open[len(closed):], nil
}

func join(msgs []json.RawMessage) json.RawMessage {
	b := []byte{'['}
	for i, m := range msgs {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, m...)
	}
	return append(b, ']')
}

func hasPrefix(s, prefix []uint32) bool {
	return len(s) >= len(prefix) && slices.Equal(s[:len(prefix)], prefix)
}

func hasSuffix(s, suffix []uint32) bool {
	return len(s) >= len(suffix) && slices.Equal(s[len(s)-len(suffix):], suffix)
}
