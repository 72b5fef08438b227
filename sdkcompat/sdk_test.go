package sdkcompat

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	goopenai "github.com/sashabaranov/go-openai"

	"github.com/kvmesh/kvmesh/loadtest/cluster"
)

const model = "sim"

// fleet is the cluster every subtest talks to, with the replica that
// served the conversation's first turn.
type fleet struct {
	*cluster.Cluster
	tokenizer string // what routers and engines tokenize with
}

// startFleet starts 2 replicas and 2 routers from bin/. With
// ../shared/tokenizers beside the repository, engines and routers use the
// real Llama 3 tokenizer and chat template (so X-Kvmesh-Prompt-Tokens must
// equal the engine's own count); without it, the builtin one.
func startFleet(t *testing.T) *fleet {
	t.Helper()
	bin := filepath.Join("..", "bin")
	for _, n := range []string{"enginesim", "sidecar", "router"} {
		if _, err := os.Stat(filepath.Join(bin, n)); err != nil {
			t.Skipf("bin/%s missing (%v): run make build first; this test starts the real binaries", n, err)
		}
	}
	f := &fleet{tokenizer: "builtin"}
	var engineArgs, routerArgs []string
	if dir, err := filepath.Abs(filepath.Join("..", "..", "shared", "tokenizers", "llama3")); err == nil {
		if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err == nil {
			f.tokenizer = dir
			engineArgs = []string{"--tokenizer", dir}
			routerArgs = []string{"--tokenizer", model + "=" + dir}
		} else {
			t.Logf("../shared/tokenizers/llama3 not found (%v): engines and routers use the builtin tokenizer", err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{BinDir: bin, OutDir: t.TempDir(), Replicas: 2, Routers: 2,
		Policy: "kvaware", Model: model, KVBlocks: 4096, TimeScale: 0.05,
		EngineArgs: engineArgs, RouterArgs: routerArgs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if killed := c.Stop(); len(killed) > 0 {
			t.Errorf("needed SIGKILL: %v", killed)
		}
	})
	f.Cluster = c
	t.Logf("fleet: routers %v, replicas %v, tokenizer %s", c.Routers, c.Names, f.tokenizer)
	return f
}

// systemPrompt is long enough to fill dozens of KV blocks.
var systemPrompt = "You are the on-call assistant of a team that runs LLM inference fleets. " +
	strings.Repeat("Answer briefly, cite the runbook section you rely on, and never restart a replica "+
		"that is still draining its streams; prefer moving traffic with the router first. ", 24)

// kvmeshHeaders is what the router says about a request it proxied.
type kvmeshHeaders struct {
	replica, mode        string
	promptTokens, cached int
}

func headersOf(t *testing.T, h http.Header) kvmeshHeaders {
	t.Helper()
	k := kvmeshHeaders{replica: h.Get("X-Kvmesh-Replica"), mode: h.Get("X-Kvmesh-Mode")}
	var err1, err2 error
	k.promptTokens, err1 = strconv.Atoi(h.Get("X-Kvmesh-Prompt-Tokens"))
	k.cached, err2 = strconv.Atoi(h.Get("X-Kvmesh-Cached-Tokens"))
	if k.replica == "" || k.mode == "" || err1 != nil || err2 != nil {
		t.Fatalf("X-Kvmesh-* headers missing or malformed: %v", h)
	}
	return k
}

// replicaView is the part of a router's /admin/replicas entry the tests
// wait on.
type replicaView struct {
	Name             string `json:"name"`
	BlockSize        int    `json:"block_size"`
	FilterKeys       int    `json:"filter_keys"`
	ClusterInflight  int    `json:"cluster_inflight_requests"`
	Waiting, Running int
}

// waitSettled waits until router lists the full blocks of a prompt of
// promptTokens in replica's filter (the sidecar has gossiped what the engine
// cached) and no request
// in flight there from any router (in-flight counts travel through the
// sidecar's load records, a beat behind): what a router decides next is
// then down to the cache, not to a request that has already finished.
func waitSettled(t *testing.T, router, replica string, promptTokens int) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	var last []replicaView
	for time.Now().Before(deadline) {
		last = nil
		if resp, err := http.Get(router + "/admin/replicas"); err == nil {
			_ = json.NewDecoder(resp.Body).Decode(&last)
			resp.Body.Close()
		}
		for _, r := range last {
			if r.Name == replica && r.BlockSize > 0 && r.FilterKeys >= promptTokens/r.BlockSize && r.ClusterInflight == 0 && r.Waiting+r.Running == 0 {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s never saw %s settled with the blocks of %d tokens: %+v", router, replica, promptTokens, last)
}

// metric sums the samples of a Prometheus counter whose line starts with
// prefix (name and, optionally, labels).
func metric(t *testing.T, router, prefix string) float64 {
	t.Helper()
	resp, err := http.Get(router + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum, found := 0.0, false
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		rest := line[len(prefix):]
		if !strings.HasPrefix(rest, " ") && !strings.HasPrefix(rest, "{") {
			continue // a longer name
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			t.Fatalf("metric line %q: %v", line, err)
		}
		sum, found = sum+v, true
	}
	if !found {
		t.Fatalf("%s/metrics has no %s", router, prefix)
	}
	return sum
}

// drain reads a go-openai stream to its end and returns its text.
func drain[T any](t *testing.T, recv func() (T, error), text func(T) string) string {
	t.Helper()
	var b strings.Builder
	for {
		c, err := recv()
		if errors.Is(err, io.EOF) {
			return b.String()
		}
		if err != nil {
			t.Fatal(err)
		}
		b.WriteString(text(c))
	}
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestOpenAIClients drives one conversation through both routers and both
// client libraries: a first turn lands cold, and every later turn that
// shares its system prompt goes to the same replica by prefix, whichever
// router it reaches, with the saving visible in headers, usage and metrics.
func TestOpenAIClients(t *testing.T) {
	f := startFleet(t)
	official := func(router string) *openai.Client {
		c := openai.NewClient(option.WithBaseURL(router+"/v1/"), option.WithAPIKey("sk-unused"), option.WithMaxRetries(0))
		return &c
	}
	community := func(router string) *goopenai.Client {
		cfg := goopenai.DefaultConfig("sk-unused")
		cfg.BaseURL = router + "/v1"
		return goopenai.NewClientWithConfig(cfg)
	}
	r0, r1 := f.Routers[0], f.Routers[1]
	communityTurn := func(question string, stream bool) goopenai.ChatCompletionRequest {
		return goopenai.ChatCompletionRequest{
			Model: model,
			Messages: []goopenai.ChatCompletionMessage{
				{Role: goopenai.ChatMessageRoleSystem, Content: systemPrompt},
				{Role: goopenai.ChatMessageRoleUser, Content: question},
			},
			MaxTokens: 12,
			Stream:    stream,
		}
	}
	turn := func(question string) openai.ChatCompletionNewParams {
		return openai.ChatCompletionNewParams{
			Model:               openai.ChatModel(model),
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(systemPrompt), openai.UserMessage(question)},
			MaxCompletionTokens: openai.Int(12),
		}
	}

	// The first turn: nothing cached anywhere yet.
	var raw *http.Response
	first, err := official(r0).Chat.Completions.New(callCtx(t), turn("Which replica should I drain first?"), option.WithResponseInto(&raw))
	if err != nil {
		t.Fatal(err)
	}
	h := headersOf(t, raw.Header)
	served := h.replica
	if !slices.Contains(f.Names, served) || h.mode != "cold" {
		t.Fatalf("first turn: replica %q mode %q, want one of %v, cold", served, h.mode, f.Names)
	}
	if len(first.Choices) != 1 || first.Choices[0].Message.Content == "" || first.Choices[0].FinishReason == "" {
		t.Fatalf("first turn: %s", first.RawJSON())
	}
	if int64(h.promptTokens) != first.Usage.PromptTokens {
		t.Fatalf("router counted %d prompt tokens, the engine %d (tokenizer %s)", h.promptTokens, first.Usage.PromptTokens, f.tokenizer)
	}
	// Both routers must know what the engine cached before the next turns
	// can be judged by their routing.
	settle := func() {
		waitSettled(t, r0, served, int(first.Usage.PromptTokens))
		waitSettled(t, r1, served, int(first.Usage.PromptTokens))
	}
	settle()

	t.Run("openai-go/stream-same-turn", func(t *testing.T) {
		// The same request streamed: the same text (enginesim's output is a
		// function of the prompt), by prefix to the same replica, and no
		// usage chunk, since the client asked for none (the router asks the
		// engine for one to count the hit, and keeps it to itself).
		var raw *http.Response
		stream := official(r0).Chat.Completions.NewStreaming(callCtx(t), turn("Which replica should I drain first?"), option.WithResponseInto(&raw))
		defer stream.Close()
		var text strings.Builder
		chunks := 0
		for stream.Next() {
			c := stream.Current()
			chunks++
			if len(c.Choices) == 0 || c.Usage.PromptTokens != 0 {
				t.Fatalf("usage reached a client that did not ask for it: %s", c.RawJSON())
			}
			text.WriteString(c.Choices[0].Delta.Content)
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		h := headersOf(t, raw.Header)
		if h.replica != served || h.mode != "prefix" || h.cached == 0 {
			t.Fatalf("streamed repeat: %+v, want %s by prefix with cached tokens", h, served)
		}
		if text.String() != first.Choices[0].Message.Content {
			t.Fatalf("streamed text %q, non-streamed %q", text.String(), first.Choices[0].Message.Content)
		}
		t.Logf("%d chunks, %+v", chunks, h)
	})

	t.Run("openai-go/stream-usage-other-router", func(t *testing.T) {
		settle()
		// A new question through the other router, asking for usage: the
		// gossiped filter sends it to the same replica, and the engine's
		// own count of cached tokens comes back in the last chunk.
		p := turn("How do I move traffic away from a slow replica?")
		p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
		var raw *http.Response
		stream := official(r1).Chat.Completions.NewStreaming(callCtx(t), p, option.WithResponseInto(&raw))
		defer stream.Close()
		acc := openai.ChatCompletionAccumulator{}
		for stream.Next() {
			acc.AddChunk(stream.Current())
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		h := headersOf(t, raw.Header)
		if h.replica != served || h.mode != "prefix" || h.cached == 0 {
			t.Fatalf("other router: %+v, want %s by prefix with cached tokens", h, served)
		}
		u := acc.Usage
		if u.PromptTokens != int64(h.promptTokens) || u.PromptTokensDetails.CachedTokens == 0 || acc.Choices[0].Message.Content == "" {
			t.Fatalf("usage %+v, content %q, headers %+v", u, acc.Choices[0].Message.Content, h)
		}
		t.Logf("predicted %d cached tokens, engine %d of %d", h.cached, u.PromptTokensDetails.CachedTokens, u.PromptTokens)
	})

	t.Run("go-openai/chat", func(t *testing.T) {
		settle()
		resp, err := community(r1).CreateChatCompletion(callCtx(t), communityTurn("What does the runbook say about draining?", false))
		if err != nil {
			t.Fatal(err)
		}
		h := headersOf(t, resp.Header())
		if h.replica != served || h.mode != "prefix" {
			t.Fatalf("%+v, want %s by prefix", h, served)
		}
		if len(resp.Choices) != 1 || resp.Choices[0].Message.Content == "" || resp.Usage.PromptTokensDetails == nil ||
			resp.Usage.PromptTokensDetails.CachedTokens == 0 || resp.Usage.PromptTokens != h.promptTokens {
			t.Fatalf("response %+v, headers %+v", resp, h)
		}
	})

	t.Run("go-openai/stream", func(t *testing.T) {
		settle()
		stream, err := community(r0).CreateChatCompletionStream(callCtx(t), communityTurn("And after draining?", true))
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		text := drain(t, stream.Recv, func(c goopenai.ChatCompletionStreamResponse) string {
			if len(c.Choices) == 0 {
				return ""
			}
			return c.Choices[0].Delta.Content
		})
		h := headersOf(t, stream.Header())
		if h.replica != served || h.mode != "prefix" || text == "" {
			t.Fatalf("%+v, text %q; want %s by prefix", h, text, served)
		}
	})

	t.Run("completions", func(t *testing.T) {
		var raw *http.Response
		c, err := official(r0).Completions.New(callCtx(t), openai.CompletionNewParams{
			Model:     openai.CompletionNewParamsModel(model),
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("The first step of a rolling restart is")},
			MaxTokens: openai.Int(8),
		}, option.WithResponseInto(&raw))
		if err != nil {
			t.Fatal(err)
		}
		h := headersOf(t, raw.Header)
		if len(c.Choices) != 1 || c.Choices[0].Text == "" || int64(h.promptTokens) != c.Usage.PromptTokens {
			t.Fatalf("completion %s, headers %+v", c.RawJSON(), h)
		}
		stream, err := community(r1).CreateCompletionStream(callCtx(t), goopenai.CompletionRequest{
			Model: model, Prompt: "The first step of a rolling restart is", MaxTokens: 8, Stream: true,
		})
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		text := drain(t, stream.Recv, func(r goopenai.CompletionResponse) string {
			if len(r.Choices) == 0 {
				return ""
			}
			return r.Choices[0].Text
		})
		if text != c.Choices[0].Text {
			t.Fatalf("streamed completion %q, non-streamed %q", text, c.Choices[0].Text)
		}
	})

	t.Run("models", func(t *testing.T) {
		page, err := official(r1).Models.List(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if len(page.Data) != 1 || page.Data[0].ID != model {
			t.Fatalf("openai-go lists %+v", page.Data)
		}
		list, err := community(r0).ListModels(callCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Models) != 1 || list.Models[0].ID != model {
			t.Fatalf("go-openai lists %+v", list.Models)
		}
	})

	t.Run("errors", func(t *testing.T) {
		// Both libraries must recognise the router's errors as API errors,
		// with their status and message.
		p := turn("hello")
		p.Model = "no-such-model"
		_, err := official(r0).Chat.Completions.New(callCtx(t), p)
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || !strings.Contains(apiErr.Message, "no-such-model") || apiErr.Type == "" {
			t.Fatalf("unknown model through openai-go: %v", err)
		}
		_, err = community(r1).CreateChatCompletion(callCtx(t), goopenai.ChatCompletionRequest{Model: model, Messages: []goopenai.ChatCompletionMessage{}})
		var gErr *goopenai.APIError
		if !errors.As(err, &gErr) || gErr.HTTPStatusCode != 400 || gErr.Message == "" {
			t.Fatalf("empty messages through go-openai: %v", err)
		}
	})

	t.Run("metrics", func(t *testing.T) {
		// What the headers said is counted: each router routed by prefix
		// and saw the engine report cached tokens.
		for _, r := range f.Routers {
			if n := metric(t, r, `kvmesh_router_routes_total{mode="prefix"}`); n < 1 {
				t.Errorf("%s: %v routes by prefix", r, n)
			}
			if n := metric(t, r, "kvmesh_router_actual_cached_tokens_total"); n <= 0 {
				t.Errorf("%s: %v actual cached tokens", r, n)
			}
			if n := metric(t, r, "kvmesh_router_prefix_hits_total"); n < 1 {
				t.Errorf("%s: %v prefix hits", r, n)
			}
		}
	})
}
