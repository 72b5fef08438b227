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
package storedid

import (
	"bytes"
	"encoding/base32"
	"strings"
)

const (
	enginePrefix = "resp_"
	marker       = "resp_kvm"
)

var enc = base32.NewEncoding("0123456789abcdefghijklmnopqrstuv").WithPadding(base32.NoPadding)

// Encode returns the id the client is given for engineID, a response stored
// by replica; ok is false for an id not in vLLM's "resp_" form or one that
// names a replica already, which are left as they are.
func Encode(replica, engineID string) (string, bool) {
	rest, isEngine := strings.CutPrefix(engineID, enginePrefix)
	if !isEngine || replica == "" || strings.HasPrefix(engineID, marker) {
		return engineID, false
	}
	return marker + enc.EncodeToString([]byte(replica)) + "_" + rest, true
}

// Decode returns the replica an id from Encode names and the engine's own
// id; ok is false for any other id, and for one with a byte no engine id
// has (such an id is then spelled the same in any JSON that carries it).
func Decode(id string) (replica, engineID string, ok bool) {
	rest, mine := strings.CutPrefix(id, marker)
	if !mine || strings.IndexFunc(rest, func(r rune) bool { return r > 0x7f || !idByte(byte(r)) }) >= 0 {
		return "", "", false
	}
	name, tail, found := strings.Cut(rest, "_")
	if !found || name == "" {
		return "", "", false
	}
	raw, err := enc.DecodeString(name)
	if err != nil || len(raw) == 0 || strings.HasPrefix(enginePrefix+tail, marker) {
		return "", "", false
	}
	return string(raw), enginePrefix + tail, true
}

// Rewrite returns b, a JSON answer of replica (a body or one stream event's
// data), with every response id in it as Encode gives it to the client; nil
// when there is none. A response id is the value of an "id",
// "previous_response_id" or "response_id" key that starts with "resp_":
// text the model wrote is a string under other keys, and any quote within
// it is escaped, so it is never taken for one.
func Rewrite(b []byte, replica string) []byte {
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
		id, ok := Encode(replica, string(b[start:end]))
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
