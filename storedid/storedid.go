// Package storedid names, in the id of a stored response, the replica that
// stores it. vLLM keeps stored responses (store: true) in the serving
// process, so a follow-up (previous_response_id) or a retrieval
// (GET /v1/responses/{id}) must reach the replica that made the response.
// Rather than a table every router would have to share, the router rewrites
// the id it hands the client to carry the replica's name, reversibly, and
// restores the engine's id on the way back in: any router can then send the
// follow-up where it belongs, and none needs to remember anything.
//
// An engine id "resp_<rest>" becomes "resp_kvm<name>_<rest>", the name in
// lower-case base32 (RFC 4648's extended hex alphabet, no padding), so the
// id stays in the alphabet and shape clients expect of one.
//
// The id may also carry a few bytes of state the router needs to predict
// the follow-up's prompt, which the engine builds from the stored history
// the router never sees (package storedchain reads and writes them):
// "resp_kvs<name>_<state>_<rest>", the state in the same base32 and at most
// MaxState bytes: at most 309 characters more than the plain form, about
// 110 for 16-token blocks (storedchain's state is 19 bytes and the tokens
// after the last full block). Routers that read the carrying form read the
// plain one as well; a router of the release before reads neither the
// state nor the replica of a carrying id, and routes its follow-up by load
// to an engine that does not know it, so every router is upgraded before
// any issues one (the router's --carry-stored-state).
package storedid

import (
	"bytes"
	"encoding/base32"
	"strings"
)

const (
	enginePrefix = "resp_"
	marker       = "resp_kvm"
	// carrying starts an id that carries state as well.
	carrying = "resp_kvs"
)

// MaxState bounds the state an id carries; Encode leaves out a longer one.
const MaxState = 192

var enc = base32.NewEncoding("0123456789abcdefghijklmnopqrstuv").WithPadding(base32.NoPadding)

// Encode returns the id the client is given for engineID, a response stored
// by replica; ok is false for an id not in vLLM's "resp_" form or one that
// names a replica already, which are left as they are.
func Encode(replica, engineID string) (string, bool) {
	return EncodeState(replica, engineID, nil)
}

// EncodeState is Encode with state carried in the id as well; state nil
// or over MaxState bytes is left out.
func EncodeState(replica, engineID string, state []byte) (string, bool) {
	rest, isEngine := strings.CutPrefix(engineID, enginePrefix)
	if !isEngine || replica == "" || ours(engineID) {
		return engineID, false
	}
	if len(state) == 0 || len(state) > MaxState {
		return marker + enc.EncodeToString([]byte(replica)) + "_" + rest, true
	}
	return carrying + enc.EncodeToString([]byte(replica)) + "_" + enc.EncodeToString(state) + "_" + rest, true
}

// ours reports an id in one of the forms Encode gives.
func ours(id string) bool { return strings.HasPrefix(id, marker) || strings.HasPrefix(id, carrying) }

// Decode returns the replica an id from Encode names and the engine's own
// id; ok is false for any other id, and for one with a byte no engine id
// has (such an id is then spelled the same in any JSON that carries it).
func Decode(id string) (replica, engineID string, ok bool) {
	replica, engineID, _, ok = DecodeState(id)
	return replica, engineID, ok
}

// DecodeState is Decode that also returns the state the id carries, nil
// for none.
func DecodeState(id string) (replica, engineID string, state []byte, ok bool) {
	rest, plain := strings.CutPrefix(id, marker)
	if !plain {
		var carries bool
		if rest, carries = strings.CutPrefix(id, carrying); !carries {
			return "", "", nil, false
		}
	}
	if strings.IndexFunc(rest, func(r rune) bool { return r > 0x7f || !idByte(byte(r)) }) >= 0 {
		return "", "", nil, false
	}
	name, tail, found := strings.Cut(rest, "_")
	if !found || name == "" {
		return "", "", nil, false
	}
	if !plain {
		var st string
		if st, tail, found = strings.Cut(tail, "_"); !found || st == "" {
			return "", "", nil, false
		}
		var err error
		if state, err = enc.DecodeString(st); err != nil || len(state) == 0 || len(state) > MaxState {
			return "", "", nil, false
		}
	}
	raw, err := enc.DecodeString(name)
	if err != nil || len(raw) == 0 || ours(enginePrefix+tail) {
		return "", "", nil, false
	}
	return string(raw), enginePrefix + tail, state, true
}

// Naming is how Rewrite names the response ids of one answer.
type Naming struct {
	// Replica made the answer; State is what its ids carry (EncodeState).
	Replica string
	State   []byte
	// Previous is the engine's id of the response the request continued,
	// and PreviousClient the id the client sent for it: the answer names
	// its predecessor as the client knows it.
	Previous, PreviousClient string
}

// Rewrite returns b, a JSON answer of replica (a body or one stream event's
// data), with every response id in it as Encode gives it to the client; nil
// when there is none. A response id is the value of an "id",
// "previous_response_id" or "response_id" key that starts with "resp_":
// text the model wrote is a string under other keys, and any quote within
// it is escaped, so it is never taken for one.
func Rewrite(b []byte, replica string) []byte { return RewriteAs(b, Naming{Replica: replica}) }

// RewriteAs is Rewrite naming the ids as n says.
func RewriteAs(b []byte, n Naming) []byte {
	var out []byte
	last := 0
	for i := 0; i < len(b); {
		j := bytes.Index(b[i:], []byte(`"`+enginePrefix))
		if j < 0 {
			break
		}
		start := i + j + 1 // the id's first byte
		if !idKey(b[:start-1]) {
			i = start
			continue
		}
		end := start
		for end < len(b) && idByte(b[end]) {
			end++
		}
		if end == len(b) || b[end] != '"' {
			i = end
			continue
		}
		engineID := string(b[start:end])
		id, ok := EncodeState(n.Replica, engineID, n.State)
		if n.Previous != "" && engineID == n.Previous && n.PreviousClient != "" {
			id, ok = n.PreviousClient, true
		}
		if ok {
			out = append(out, b[last:start]...)
			out = append(out, id...)
			last = end
		}
		i = end + 1
	}
	if out == nil {
		return nil
	}
	return append(out, b[last:]...)
}

// idKeys are the keys whose values are response ids.
var idKeys = []string{"id", "previous_response_id", "response_id"}

// idKey reports whether b, valid JSON up to a value, ends with one of
// idKeys and its colon.
func idKey(b []byte) bool {
	b = bytes.TrimRight(b, " ")
	if len(b) == 0 || b[len(b)-1] != ':' {
		return false
	}
	b = bytes.TrimRight(b[:len(b)-1], " ")
	for _, k := range idKeys {
		if bytes.HasSuffix(b, []byte(`"`+k+`"`)) {
			// The key's opening quote must start the key, not end an
			// escaped quote inside a longer string.
			if n := len(b) - len(k) - 2; n == 0 || b[n-1] != '\\' {
				return true
			}
		}
	}
	return false
}

// idByte reports a byte an engine's response id is made of (vLLM's: hex
// digits; OpenAI's: alphanumerics; either with dashes or underscores).
func idByte(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '-' || c == '_'
}
