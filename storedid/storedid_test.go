package storedid

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestEncodeDecode(t *testing.T) {
	for _, c := range []struct{ replica, id string }{
		{"a", "resp_0123abcd"},
		{"sim-7.pod.svc:8000", "resp_9f86d081884c7d659a2feaa0c55ad015"},
		{"名前", "resp_x_y"},
	} {
		got, ok := Encode(c.replica, c.id)
		if !ok || !strings.HasPrefix(got, "resp_") || strings.ContainsAny(got, "=.:") {
			t.Fatalf("Encode(%q, %q) = %q, %v", c.replica, c.id, got, ok)
		}
		r, id, ok := Decode(got)
		if !ok || r != c.replica || id != c.id {
			t.Errorf("Decode(%q) = %q %q %v, want %q %q", got, r, id, ok, c.replica, c.id)
		}
		if again, ok := Encode("b", got); ok || again != got {
			t.Errorf("an id naming a replica was named again: %q", again)
		}
	}
	for _, id := range []string{"resp_0123", "chatcmpl-1", "resp_kvm", "resp_kvm_x", "resp_kvmzz_x", "", "resp_kvmc4_a\"b", "resp_kvmc4_a b"} {
		if _, _, ok := Decode(id); ok {
			t.Errorf("Decode(%q) took it for one of ours", id)
		}
	}
	if _, ok := Encode("a", "msg_1"); ok {
		t.Error("an item id was rewritten")
	}
}

func TestRewrite(t *testing.T) {
	a, _ := Encode("a", "resp_1")
	cases := []struct{ in, want string }{
		{`{"id":"resp_1","object":"response","output":[{"id":"msg_2"}]}`, `{"id":"` + a + `","object":"response","output":[{"id":"msg_2"}]}`},
		{`{"type":"response.created","response":{"id":"resp_1","previous_response_id":"resp_1"}}`,
			`{"type":"response.created","response":{"id":"` + a + `","previous_response_id":"` + a + `"}}`},
		{`{"text":"say \"resp_1\" twice"}`, ""},
		{`{"id":"msg_1","delta":"resp_1"}`, ""},
		{`{"id":"` + a + `"}`, ""},
		{`{"text":"\"id\":\"resp_1\""}`, ""},
		{`{"response_id": "resp_1"}`, `{"response_id": "` + a + `"}`},
		{`{"id":"resp_1`, ""},
	}
	for _, c := range cases {
		if got := string(Rewrite([]byte(c.in), "a")); got != c.want {
			t.Errorf("Rewrite(%s) =\n %s\nwant\n %s", c.in, got, c.want)
		}
	}
}

// TestCarriedState: an id that carries state decodes to the same replica,
// engine id and state; an answer names its own id with the state and its
// predecessor as the client sent it; a state too long is left out.
func TestCarriedState(t *testing.T) {
	state := []byte{1, 2, 3, 0xff, 0}
	id, ok := EncodeState("sim-1", "resp_9f86d0", state)
	if !ok || !strings.HasPrefix(id, "resp_kvs") || strings.ContainsAny(id, "=.:") {
		t.Fatalf("EncodeState = %q %v", id, ok)
	}
	r, eid, st, ok := DecodeState(id)
	if !ok || r != "sim-1" || eid != "resp_9f86d0" || string(st) != string(state) {
		t.Fatalf("DecodeState(%q) = %q %q %x %v", id, r, eid, st, ok)
	}
	if r, eid, ok := Decode(id); !ok || r != "sim-1" || eid != "resp_9f86d0" {
		t.Errorf("Decode(%q) = %q %q %v", id, r, eid, ok)
	}
	if again, ok := EncodeState("b", id, state); ok || again != id {
		t.Errorf("an id naming a replica was named again: %q", again)
	}
	plain, _ := Encode("sim-1", "resp_9f86d0")
	if _, _, st, ok := DecodeState(plain); !ok || st != nil {
		t.Errorf("a plain id carries %x", st)
	}
	if long, _ := EncodeState("a", "resp_1", make([]byte, MaxState+1)); !strings.HasPrefix(long, marker) {
		t.Errorf("a state over MaxState was carried: %q", long)
	}
	got := string(RewriteAs([]byte(`{"id":"resp_2","previous_response_id":"resp_1"}`), Naming{Replica: "sim-1", State: state, Previous: "resp_1", PreviousClient: id}))
	mine, _ := EncodeState("sim-1", "resp_2", state)
	if want := `{"id":"` + mine + `","previous_response_id":"` + id + `"}`; got != want {
		t.Errorf("RewriteAs =\n %s\nwant\n %s", got, want)
	}
	for _, bad := range []string{"resp_kvs", "resp_kvsc4_", "resp_kvsc4__1", "resp_kvsc4_zz_1", "resp_kvs_04_1"} {
		if _, _, _, ok := DecodeState(bad); ok {
			t.Errorf("DecodeState(%q) took it for one of ours", bad)
		}
	}
}

func FuzzDecode(f *testing.F) {
	id, _ := Encode("replica-1", "resp_abc")
	f.Add(id)
	f.Add("resp_kvm00_")
	carried, _ := EncodeState("replica-1", "resp_abc", []byte{1, 2, 3})
	f.Add(carried)
	f.Fuzz(func(t *testing.T, s string) {
		r, eid, st, ok := DecodeState(s)
		if !ok {
			return
		}
		if len(st) > MaxState {
			t.Fatalf("%q carries %d bytes", s, len(st))
		}
		// Base32 without padding admits a few spellings of one name: the
		// canonical one must decode to the same triple.
		again, encoded := EncodeState(r, eid, st)
		if r2, e2, st2, ok2 := DecodeState(again); !encoded || !ok2 || r2 != r || e2 != eid || string(st2) != string(st) {
			t.Fatalf("%q → %q %q %x → %q", s, r, eid, st, again)
		}
		_ = Rewrite([]byte(`{"id":"`+s+`"}`), r)
	})
}

// FuzzRewrite: any answer is safe to rewrite, a valid JSON one stays valid
// JSON, and every id it wrote decodes back to the replica.
func FuzzRewrite(f *testing.F) {
	f.Add([]byte(`{"id":"resp_1","output":[{"id":"msg_1","text":"\"id\":\"resp_2\""}],"previous_response_id":"resp_3"}`))
	f.Add([]byte(`{"id" : "resp_a-b_c"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		out := Rewrite(b, "r")
		if out == nil {
			return
		}
		if json.Valid(b) && !json.Valid(out) {
			t.Fatalf("%s became %s", b, out)
		}
		for _, part := range strings.Split(string(out), `"resp_kvm`)[1:] {
			id := "resp_kvm" + part[:strings.IndexByte(part+`"`, '"')]
			if strings.Contains(string(b), id) {
				continue // in the answer as it came
			}
			if r, _, ok := Decode(id); !ok || r != "r" {
				t.Fatalf("%q in %s does not name the replica", id, out)
			}
		}
	})
}
