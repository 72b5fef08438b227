package sdkcompat

import (
	"bytes"
	"encoding/json"
	"net/http"
	"slices"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"

	"github.com/kvmesh/kvmesh/storedid"
)

// TestResponsesThroughTheOfficialClient drives a Responses conversation
// with openai-go through both routers of a real fleet (sidecars, gossip,
// the real Llama 3 template when ../shared holds it): the router counts
// the engine's prompt tokens, predicts its cached tokens on a later turn,
// and a stored response's follow-up and retrieval reach the replica that
// stored it, whichever router they reach, with ids the client takes as
// any other.
func TestResponsesThroughTheOfficialClient(t *testing.T) {
	f := startFleet(t)
	r0, r1 := f.Routers[0], f.Routers[1]
	client := func(router string) *openai.Client {
		c := openai.NewClient(option.WithBaseURL(router+"/v1/"), option.WithAPIKey("sk-unused"), option.WithMaxRetries(0))
		return &c
	}
	ask := func(question, previous string) responses.ResponseNewParams {
		p := responses.ResponseNewParams{
			Model:           model,
			Instructions:    openai.String(systemPrompt),
			Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(question)},
			MaxOutputTokens: openai.Int(8),
		}
		if previous != "" {
			p.PreviousResponseID = openai.String(previous)
		}
		return p
	}

	var raw *http.Response
	first, err := client(r0).Responses.New(callCtx(t), ask("Which replica should I drain first?", ""), option.WithResponseInto(&raw))
	if err != nil {
		t.Fatal(err)
	}
	h := headersOf(t, raw.Header)
	served := h.replica
	named, _, ok := storedid.Decode(first.ID)
	if !ok || !slices.Contains(f.Names, served) || named != served || first.OutputText() == "" {
		t.Fatalf("first turn: replica %q, id %q (names %q), text %q", served, first.ID, named, first.OutputText())
	}
	if int64(h.promptTokens) != first.Usage.InputTokens {
		t.Fatalf("router counted %d prompt tokens, the engine %d (tokenizer %s)", h.promptTokens, first.Usage.InputTokens, f.tokenizer)
	}
	waitSettled(t, r0, served, int(first.Usage.InputTokens))
	waitSettled(t, r1, served, int(first.Usage.InputTokens))

	// Another question under the same instructions, at the other router:
	// by prefix to the same replica, predicting what the engine reports.
	second, err := client(r1).Responses.New(callCtx(t), ask("How do I move traffic away from a slow replica?", ""), option.WithResponseInto(&raw))
	if err != nil {
		t.Fatal(err)
	}
	h = headersOf(t, raw.Header)
	if h.replica != served || h.mode != "prefix" || int64(h.cached) != second.Usage.InputTokensDetails.CachedTokens || h.cached == 0 {
		t.Fatalf("second turn: %+v, the engine cached %d of %d; want %s by prefix, the same count", h, second.Usage.InputTokensDetails.CachedTokens, second.Usage.InputTokens, served)
	}
	t.Logf("second turn: predicted %d cached tokens, engine %d of %d", h.cached, second.Usage.InputTokensDetails.CachedTokens, second.Usage.InputTokens)

	// A streamed follow-up of the first response, through the other router.
	stream := client(r1).Responses.NewStreaming(callCtx(t), ask("And after draining?", first.ID), option.WithResponseInto(&raw))
	defer stream.Close()
	var completed responses.Response
	text := ""
	for stream.Next() {
		ev := stream.Current()
		switch ev.Type {
		case "response.output_text.delta":
			text += ev.Delta
		case "response.completed":
			completed = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if r := raw.Header.Get("X-Kvmesh-Replica"); r != served || text == "" || completed.PreviousResponseID != first.ID || completed.Usage.InputTokens <= first.Usage.InputTokens {
		t.Fatalf("follow-up: at %s, text %q, previous %q, %d input tokens", r, text, completed.PreviousResponseID, completed.Usage.InputTokens)
	}
	got, err := client(r0).Responses.Get(callCtx(t), completed.ID, responses.ResponseGetParams{})
	if err != nil || got.ID != completed.ID || got.OutputText() != text {
		t.Fatalf("retrieve %s: %v %+v", completed.ID, err, got)
	}

	// The same system prompt through the Messages API: vLLM renders it the
	// same, so it finds the same blocks, and the router predicts what the
	// engine reports as read from its cache.
	waitSettled(t, r0, served, int(first.Usage.InputTokens))
	body, _ := json.Marshal(map[string]any{"model": model, "system": systemPrompt, "max_tokens": 8,
		"messages": []map[string]any{{"role": "user", "content": "Which runbook section covers draining?"}}})
	resp, err := http.Post(r0+"/v1/messages", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var msg struct {
		Type  string
		Usage struct {
			InputTokens int `json:"input_tokens"`
			CacheRead   int `json:"cache_read_input_tokens"`
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&msg); err != nil || resp.StatusCode != 200 || msg.Type != "message" {
		t.Fatalf("messages: %d %v %+v", resp.StatusCode, err, msg)
	}
	h = headersOf(t, resp.Header)
	if h.replica != served || h.mode != "prefix" || h.cached != msg.Usage.CacheRead || h.promptTokens != msg.Usage.InputTokens+msg.Usage.CacheRead {
		t.Fatalf("messages: %+v, the engine read %d from its cache of %d; want %s by prefix, the same counts", h, msg.Usage.CacheRead, msg.Usage.InputTokens+msg.Usage.CacheRead, served)
	}
	t.Logf("messages: predicted %d cached tokens, engine %d of %d", h.cached, msg.Usage.CacheRead, msg.Usage.InputTokens+msg.Usage.CacheRead)
}
