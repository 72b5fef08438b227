// Command sidecar runs beside one engine: it follows the engine's KV-cache
// events and load, and sends both to every kvmesh router over the gossip
// cluster. See CONTRACT.md for flags and /status.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	// Mozilla's roots, used only where the system has none (the FROM
	// scratch image), so https upstreams verify without mounting certificates.
	_ "golang.org/x/crypto/x509roots/fallback"

	"github.com/kvmesh/kvmesh/flagenv"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/memberflags"
	"github.com/kvmesh/kvmesh/residentset"
	"github.com/kvmesh/kvmesh/sidecar"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "sidecar:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("sidecar", flag.ContinueOnError)
	var (
		cfg                    sidecar.Config
		member                 memberflags.Flags
		loraIDs, offloadMedia  string
		kvRole, transferConfig string
		dpRank                 int
	)
	host, _ := os.Hostname()
	fs.StringVar(&cfg.EngineURL, "engine", "http://127.0.0.1:8000", "engine base URL")
	fs.StringVar(&cfg.KVEvents, "kv-events", "", "engine's KV events PUB endpoint to connect to (e.g. tcp://127.0.0.1:5557)")
	fs.StringVar(&cfg.KVEventsBind, "kv-events-bind", "", "endpoint to bind for a publisher that connects (e.g. tcp://*:5557)")
	fs.StringVar(&cfg.KVReplay, "kv-replay", "", "engine's KV events replay (ROUTER) endpoint")
	fs.StringVar(&cfg.KVTopic, "kv-topic", "", "KV events topic prefix (empty: all)")
	fs.Int64Var(&cfg.KVMaxMessageBytes, "kv-events-max-message-bytes", kvevents.DefaultMaxMessageBytes, "largest KV events message (all its frames) a publisher may send; a peer declaring more is dropped")
	fs.DurationVar(&cfg.KVHandshakeTimeout, "kv-events-handshake-timeout", kvevents.DefaultHandshakeTimeout, "time a KV events connection has to complete its ZMTP handshake")
	fs.StringVar(&cfg.Name, "name", host, "replica name, unique in the cluster")
	member.Register(fs, "0.0.0.0:7946")
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:9100", "status and metrics HTTP address")
	fs.StringVar(&cfg.Protocol, "protocol", "vllm", "engine dialect for metrics: vllm or sglang")
	fs.DurationVar(&cfg.ScrapeInterval, "scrape-interval", 200*time.Millisecond, "engine /health and /metrics interval")
	fs.Float64Var(&cfg.FilterFPR, "filter-fpr", 0.01, "Bloom filter target false-positive rate")
	fs.IntVar(&cfg.Capacity, "capacity", 65536, "engine KV capacity in blocks: sizes the filter (refused if gossip cannot carry it) and bounds the exact set until the engine reports its num_gpu_blocks")
	fs.Float64Var(&cfg.ResidentSlack, "resident-slack", 0.25, "fraction of the engine's capacity the exact set may hold beyond it before refusing stores")
	fs.IntVar(&cfg.OffloadCapacity, "offload-capacity", 0, "engine's offload tier (host memory: vLLM's OffloadingConnector, LMCache) in blocks: blocks held only there are published apart, for routers to price as a load; 0: blocks on media other than GPU are ignored")
	fs.StringVar(&offloadMedia, "offload-media", "CPU", "offload tiers followed with --offload-capacity (comma list, cheapest to load from first), as the engine's events name them")
	fs.IntVar(&cfg.MaxKVGroups, "max-kv-groups", residentset.DefaultMaxGroups, "KV-cache groups (group_idx 0..N-1) followed; events of others are refused")
	fs.IntVar(&dpRank, "data-parallel-rank", -1, "data-parallel rank of the engine server (--engine, shared by its ranks) this sidecar follows: --kv-events is that rank's port, its /metrics samples are read and routers send X-data-parallel-rank with it; -1: the engine is not data-parallel")
	fs.StringVar(&kvRole, "kv-role", "", "engine's side of prefill/decode disaggregation: prefill (routers send it prefills for remote decodes), decode (decodes, and whole requests it prefills itself) or both; empty: --kv-transfer-config's kv_role, else both")
	fs.StringVar(&transferConfig, "kv-transfer-config", "", "the engine's --kv-transfer-config JSON, whose kv_role (kv_producer, kv_consumer, kv_both) names the role when --kv-role does not (NixlConnector deployments often run both pools as kv_both: name them with --kv-role)")
	fs.StringVar(&loraIDs, "lora-ids", "", "NAME=ID,...: LoRA adapter names for the numeric ids vLLM before v0.14 sends alone")
	if err := flagenv.Parse(fs, args); err != nil {
		if err == flag.ErrHelp {
			return nil
		}
		return err
	}
	log, err := member.Log.Logger(nil, "sidecar")
	if err != nil {
		return err
	}
	cfg.Logger = log
	if cfg.Gossip, err = member.Gossip(); err != nil {
		return err
	}
	cfg.EngineAPIKey = member.EngineAPIKey
	if dpRank < -1 {
		return fmt.Errorf("--data-parallel-rank %d: want a rank ≥ 0, or -1 for none", dpRank)
	}
	cfg.DataParallel, cfg.DataParallelRank = dpRank >= 0, dpRank
	cfg.OffloadMedia = strings.Split(offloadMedia, ",")
	if cfg.KVRole, err = sidecar.KVRoleOf(kvRole, transferConfig); err != nil {
		return err
	}
	if cfg.LoRANames, err = sidecar.ParseLoRAIDs(loraIDs); err != nil {
		return err
	}
	s, err := sidecar.New(cfg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	return s.Run(ctx)
}
