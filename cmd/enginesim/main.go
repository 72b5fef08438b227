// Command enginesim is a simulated LLM engine that speaks vLLM's dialect:
// OpenAI endpoints, /tokenize, /metrics with vLLM's names, and KV-cache
// events over ZMQ, with a real paged prefix cache and calibrated timing.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/buildinfo"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/enginesim"
	"github.com/kvmesh/kvmesh/flagenv"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/listener"
	"github.com/kvmesh/kvmesh/logging"
	"github.com/kvmesh/kvmesh/tokenize"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "enginesim:", err)
		os.Exit(1)
	}
}

type options struct {
	listen, model, tokenizer     string
	kvEvents, kvReplay, kvTopic  string
	kvFormat, apiKey             string
	costProfile                  string
	blockSize, kvBlocks          int
	maxNumSeqs, maxBatchedTokens int
	schedulingPolicy             string
	maxModelLen                  int
	dataParallelSize             int
	cpuOffloadBlocks             int
	cpuLoadUsPerToken            float64
	cpuOffloadEvents             string
	kvRole, kvEngineID           string
	kvTransferHost               string
	kvLoadFailurePolicy          string
	kvTransferUsPerToken         float64
	kvTransferTimeout            time.Duration
	kvMaxMessageBytes            int64
	kvHandshakeTimeout           time.Duration
	timeScale                    float64
	log                          logging.Options
}

// run serves until ctx ends or the listener fails.
func run(ctx context.Context, args []string) error {
	var o options
	fs := flag.NewFlagSet("enginesim", flag.ContinueOnError)
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8000", "HTTP listen address")
	fs.StringVar(&o.model, "model", "enginesim", "served model name")
	fs.StringVar(&o.apiKey, "api-key", "", "bearer token every /v1 call must carry, as vllm serve --api-key; prefer the env variable")
	fs.StringVar(&o.tokenizer, "tokenizer", "builtin", "tokenizer: builtin or a HuggingFace model directory")
	fs.IntVar(&o.blockSize, "block-size", 16, "KV block size in tokens")
	fs.IntVar(&o.kvBlocks, "kv-blocks", 51200, "KV cache capacity in blocks (51,200 × 16 tokens ≈ 100 GiB of an 8B model's KV)")
	fs.StringVar(&o.kvEvents, "kv-events", "", "ZMQ PUB endpoint for KV events; a wildcard host (tcp://*:5557) binds, a concrete host connects; empty disables")
	fs.StringVar(&o.kvReplay, "kv-replay", "", "ZMQ ROUTER endpoint serving replay of recent event batches (optional)")
	fs.StringVar(&o.kvTopic, "kv-topic", "", "topic frame of every KV-event message")
	fs.StringVar(&o.kvFormat, "kv-events-format", "vllm", "KV-event encoding: vllm (v0.26+ map events), vllm-array (older array events) or sglang")
	fs.Int64Var(&o.kvMaxMessageBytes, "kv-events-max-message-bytes", kvevents.DefaultMaxMessageBytes, "largest message a KV-events peer (subscriber, replay client) may send; a peer declaring more is dropped")
	fs.DurationVar(&o.kvHandshakeTimeout, "kv-events-handshake-timeout", kvevents.DefaultHandshakeTimeout, "time a KV-events connection has to complete its ZMTP handshake")
	fs.Float64Var(&o.timeScale, "time-scale", 1, "real seconds per simulated second: 1 real time, 0.1 ten times faster, 0 no delay")
	fs.IntVar(&o.maxNumSeqs, "max-num-seqs", 256, "maximum running sequences per step")
	fs.StringVar(&o.schedulingPolicy, "scheduling-policy", "fcfs", "fcfs, or priority: the waiting queue by each request's priority field (lower first), then arrival, and the lowest-priority request preempted first, as vllm serve --scheduling-policy priority")
	fs.IntVar(&o.maxBatchedTokens, "max-num-batched-tokens", 8192, "token budget per step (longer prefills are chunked)")
	fs.IntVar(&o.maxModelLen, "max-model-len", 32768, "maximum prompt plus output tokens")
	fs.IntVar(&o.dataParallelSize, "data-parallel-size", 1, "independent engines (vLLM data-parallel ranks) behind the one HTTP server, each with its own KV cache, scheduler and KV-event publisher on --kv-events (and --kv-replay) with the port shifted by the rank; X-data-parallel-rank picks a rank, otherwise vLLM's internal balancer does")
	fs.IntVar(&o.cpuOffloadBlocks, "cpu-offload-blocks", 0, "host-memory KV tier in blocks, as vLLM's OffloadingConnector with its CPU backend: every GPU block is written through to it (LRU), a prefix the GPU cache lost but the host holds is loaded back instead of recomputed, and its KV events carry medium CPU; 0 disables it")
	fs.Float64Var(&o.cpuLoadUsPerToken, "cpu-load-us-per-token", engine.DefaultCPULoadUsPerToken, "cost in µs per token of loading KV back from the host tier, instead of computing it; the default is 131,072 B/token of an 8B model over ≈50 GB/s of PCIe Gen5 x16")
	fs.StringVar(&o.cpuOffloadEvents, "cpu-offload-events", "self-describing", "the host tier's BlockStored events: self-describing (vLLM v0.24+ with self_describing_kv_events: parent, tokens, block size) or placeholder (vLLM's default: the hash alone)")
	fs.StringVar(&o.kvRole, "kv-role", "both", "side of vLLM's prefill/decode disaggregation (kv_transfer_params, NixlConnector's) this engine plays: prefill (kv_producer: a request with do_remote_decode keeps its blocks and is answered with kv_transfer_params naming them), decode (kv_consumer: a request with do_remote_prefill reads them and is charged the transfer instead of the prefill), or both (kv_both)")
	fs.Float64Var(&o.kvTransferUsPerToken, "kv-transfer-us-per-token", engine.DefaultTransferUsPerToken, "cost in µs per token of receiving a remote prefill's KV, instead of computing it; the default is 131,072 B/token of an 8B model over ≈40 GB/s, 80 % of a 400 Gb/s NIC")
	fs.DurationVar(&o.kvTransferTimeout, "kv-transfer-timeout", enginesim.DefaultKVTransferTimeout, "how long, in simulated time, a prefill's blocks stay held for a decode engine that does not read them (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
	fs.StringVar(&o.kvLoadFailurePolicy, "kv-load-failure-policy", "fail", "what a decode engine does when it cannot read a remote prefill's KV (expired, not held, engine gone), as vLLM's kv_load_failure_policy: fail (its default: the request gets vLLM's 500 \"Internal server error\") or recompute (the prompt is computed locally)")
	fs.StringVar(&o.kvEngineID, "kv-engine-id", "", "remote_engine_id in kv_transfer_params (vLLM's kv_transfer_config engine_id, _dpR appended per data-parallel rank); empty: a random one")
	fs.StringVar(&o.kvTransferHost, "kv-transfer-host", "", "remote_host in kv_transfer_params, the host decode engines read held blocks from (enginesim's side channel is its HTTP port); empty: the --listen host, localhost for a wildcard one (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST default)")
	fs.StringVar(&o.costProfile, "cost-profile", "", `step cost overrides, key=value list or JSON: floor_ms, prefill_us_per_token, prefill_ns_per_pair, decode_us_per_seq, decode_ns_per_context_token (default calibrated to an 8B model on one H200 with a 5 ms floor)`)
	o.log.Register(fs)
	if err := flagenv.Parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.schedulingPolicy != "fcfs" && o.schedulingPolicy != "priority" {
		return fmt.Errorf("--scheduling-policy %q: want fcfs or priority", o.schedulingPolicy)
	}
	if o.cpuOffloadBlocks < 0 || !(o.cpuLoadUsPerToken > 0) {
		return fmt.Errorf("--cpu-offload-blocks %d, --cpu-load-us-per-token %v: want ≥ 0 and > 0", o.cpuOffloadBlocks, o.cpuLoadUsPerToken)
	}
	if o.cpuOffloadEvents != "self-describing" && o.cpuOffloadEvents != "placeholder" {
		return fmt.Errorf("--cpu-offload-events %q: want self-describing or placeholder", o.cpuOffloadEvents)
	}
	if o.kvRole != "both" && o.kvRole != "prefill" && o.kvRole != "decode" {
		return fmt.Errorf("--kv-role %q: want prefill, decode or both", o.kvRole)
	}
	if o.kvLoadFailurePolicy != "fail" && o.kvLoadFailurePolicy != "recompute" {
		return fmt.Errorf("--kv-load-failure-policy %q: want fail or recompute", o.kvLoadFailurePolicy)
	}
	if !(o.kvTransferUsPerToken > 0) || o.kvTransferTimeout <= 0 {
		return fmt.Errorf("--kv-transfer-us-per-token %v, --kv-transfer-timeout %v: want > 0", o.kvTransferUsPerToken, o.kvTransferTimeout)
	}
	if o.dataParallelSize < 1 {
		return fmt.Errorf("--data-parallel-size %d: want ≥ 1", o.dataParallelSize)
	}
	log, err := o.log.Logger(nil, "enginesim")
	if err != nil {
		return err
	}
	cost, err := engine.ParseCostProfile(engine.DefaultCost, o.costProfile)
	if err != nil {
		return err
	}
	tok, err := loadTokenizer(o.tokenizer)
	if err != nil {
		return err
	}
	pubs, err := newPublishers(o, log.With().Str("component", "kvevents").Logger())
	if err != nil {
		return err
	}
	defer pubs.Close()
	// Listen first: kv_transfer_params name the address decode engines
	// reach.
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return err
	}
	defer ln.Close()
	srv, err := enginesim.New(enginesim.Config{
		Model:     o.model,
		Tokenizer: tok,
		Engine: engine.Config{
			BlockSize: o.blockSize, KVBlocks: o.kvBlocks,
			MaxNumSeqs: o.maxNumSeqs, MaxNumBatchedTokens: o.maxBatchedTokens,
			MaxModelLen: o.maxModelLen, Cost: cost, PriorityScheduling: o.schedulingPolicy == "priority",
			CPUBlocks: o.cpuOffloadBlocks, CPULoadUsPerToken: o.cpuLoadUsPerToken,
			CPUPlaceholderEvents: o.cpuOffloadEvents == "placeholder",
			TransferUsPerToken:   o.kvTransferUsPerToken,
		},
		KVRole:              enginesim.KVRole(o.kvRole),
		KVTransferTimeout:   o.kvTransferTimeout,
		KVLoadFailurePolicy: enginesim.KVLoadFailurePolicy(o.kvLoadFailurePolicy),
		EngineID:            o.kvEngineID,
		SideChannel:         sideChannel(ln.Addr(), o.kvTransferHost),
		TimeScale:           o.timeScale,
		DataParallelSize:    o.dataParallelSize,
		Events:              sink(pubs),
		APIKey:              o.apiKey,
		Logger:              log,
	})
	if err != nil {
		return err
	}

	// fasthttp's Serve returns on an accept error (EMFILE under a load test
	// with a low nofile): keep accepting instead.
	ln = listener.Guard(ln, log)
	engineCtx, stopEngine := context.WithCancel(context.Background())
	engineDone := make(chan struct{})
	go func() { srv.Run(engineCtx); close(engineDone) }()

	hs := &fasthttp.Server{
		Handler:            srv.Handler,
		Name:               "enginesim",
		MaxRequestBodySize: 64 << 20,
		ReadBufferSize:     16 << 10,
		IdleTimeout:        5 * time.Second, // uvicorn's keep-alive, as vLLM
		CloseOnShutdown:    true,
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- hs.Serve(ln) }()
	log.Info().Str("version", buildinfo.Version()).Str("listen", ln.Addr().String()).Str("model", o.model).Str("tokenizer", o.tokenizer).
		Int("block_size", o.blockSize).Int("kv_blocks", o.kvBlocks).Float64("time_scale", o.timeScale).
		Str("kv_events", o.kvEvents).Str("kv_role", o.kvRole).Int("data_parallel_size", o.dataParallelSize).Int("cpu_offload_blocks", o.cpuOffloadBlocks).Interface("cost", cost).Msg("serving")
	select {
	case err = <-serveErr:
	case <-ctx.Done():
		log.Info().Msg("shutting down")
	}
	stopEngine()
	<-engineDone
	shutCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = hs.ShutdownWithContext(shutCtx)
	return err
}

// sideChannel is the host:port kv_transfer_params name for reading held
// blocks: host, else the listener's host, localhost for a wildcard one.
func sideChannel(addr net.Addr, host string) string {
	h, port, _ := net.SplitHostPort(addr.String())
	if host == "" {
		host = h
		if ip := net.ParseIP(h); ip != nil && ip.IsUnspecified() {
			host = "localhost"
		}
	}
	return net.JoinHostPort(host, port)
}

func loadTokenizer(spec string) (tokenize.Model, error) {
	if spec == "builtin" {
		return tokenize.Builtin{}, nil
	}
	t, err := tokenize.LoadDir(spec)
	if err != nil {
		return nil, fmt.Errorf("--tokenizer %q: %w", spec, err)
	}
	return t, nil
}
