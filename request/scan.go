package request

import (
	"bytes"
	"encoding/json"

	"github.com/kvmesh/kvmesh/jsonscan"
)

// decodeTop fills r from the top-level fields of body, which json.Valid has
// accepted: one pass over the object, decoding only the few small values
// routing needs and keeping the large ones (messages, prompt, tools) as
// raw spans. Later duplicates win, as with encoding/json. Keys are matched
// as written (a key spelled with escapes is not recognised).
func decodeTop(body []byte, r *fields) error {
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return Invalid("request body must be a JSON object")
	}
	i++
	for {
		i = skipSpace(body, i)
		if i < len(body) && body[i] == '}' {
			return nil
		}
		if i >= len(body) || body[i] != '"' {
			return Invalid("malformed JSON object")
		}
		kEnd := jsonscan.ValueEnd(body, i)
		key := body[i+1 : kEnd-1]
		i = skipSpace(body, kEnd)
		if i >= len(body) || body[i] != ':' {
			return Invalid("malformed JSON object")
		}
		i = skipSpace(body, i+1)
		vEnd := jsonscan.ValueEnd(body, i)
		if vEnd <= i {
			return Invalid("malformed JSON object")
		}
		if err := r.set(key, body[i:vEnd]); err != nil {
			return err
		}
		i = skipSpace(body, vEnd)
		if i < len(body) && body[i] == ',' {
			i++
		}
	}
}

func (r *fields) set(key, v []byte) error {
	var err error
	switch string(key) {
	case "model":
		err = setString(&r.Model, v, "model")
	case "messages":
		r.Messages = v
	case "prompt":
		r.Prompt = v
	case "tools":
		r.Tools = v
	case "stream":
		r.Stream, err = setBool(v, "stream")
	case "stream_options":
		r.StreamOptions = v
	case "add_special_tokens":
		r.AddSpecialTokens, err = setBool(v, "add_special_tokens")
	case "add_generation_prompt":
		r.AddGenerationPrompt, err = setBool(v, "add_generation_prompt")
	case "continue_final_message":
		r.ContinueFinalMessage, err = setBool(v, "continue_final_message")
	case "chat_template_kwargs":
		r.ChatTemplateKwargs = v
	case "max_tokens", "max_completion_tokens":
		r.MaxTokens = v // the engine validates it
	case "cache_salt":
		if string(v) == "null" {
			r.CacheSalt = nil
			return nil
		}
		var s string
		if err = setString(&s, v, "cache_salt"); err == nil {
			r.CacheSalt = &s
		}
	}
	return err
}

func wrongType(field string, v []byte, want string) error {
	got := "string"
	switch v[0] {
	case '{':
		got = "object"
	case '[':
		got = "array"
	case 't', 'f':
		got = "bool"
	case 'n':
		got = "null"
	case '"':
	default:
		got = "number"
	}
	return Invalid("field %q has the wrong type: got %s, want %s", field, got, want)
}

// setString sets *dst from a JSON string (null leaves it unchanged).
func setString(dst *string, v []byte, field string) error {
	switch v[0] {
	case 'n':
		return nil
	case '"':
		if bytes.IndexByte(v, '\\') < 0 {
			*dst = string(v[1 : len(v)-1])
			return nil
		}
		// Decoded into a string of its own: dst would escape to the heap
		// through json.Unmarshal, and with it every request's fields.
		var unquoted string
		if err := json.Unmarshal(v, &unquoted); err != nil {
			return Invalid("field %q: %v", field, err)
		}
		*dst = unquoted
		return nil
	}
	return wrongType(field, v, "string")
}

func setBool(v []byte, field string) (*bool, error) {
	switch string(v) {
	case "true":
		t := true
		return &t, nil
	case "false":
		f := false
		return &f, nil
	case "null":
		return nil, nil
	}
	return nil, wrongType(field, v, "bool")
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r' || b[i] == '\n') {
		i++
	}
	return i
}
