// Package sidecar wires what runs beside one engine: its KV events feed the
// exact resident set and the filter generations, its /health and /metrics
// feed the load record, and a gossip sidecar member sends both to every
// router. It serves /status, /metrics and /health for operators.
//
// With an offload tier (Config.OffloadCapacity), blocks the engine holds
// only in host memory go into the same filter under tier-salted keys
// (package residentset says why), announced in the node metadata, and the
// exact set and filter are sized for both tiers.
package sidecar

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/buildinfo"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gossip"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/listener"
	"github.com/kvmesh/kvmesh/residentset"
)

// Config is everything a sidecar needs.
type Config struct {
	Name      string
	EngineURL string // engine base URL, e.g. http://127.0.0.1:8000
	Protocol  string // "vllm" or "sglang"
	// EngineAPIKey, when set, is sent as a bearer token on every call to
	// the engine: vLLM and SGLang started with --api-key refuse /v1/models
	// without it.
	EngineAPIKey string

	// KVEvents is the engine's PUB endpoint to connect to; KVEventsBind an
	// endpoint to bind for publishers that connect. One of them, or neither
	// for a load-only replica.
	KVEvents     string
	KVEventsBind string
	KVReplay     string
	KVTopic      string
	// KVMaxMessageBytes and KVHandshakeTimeout bound each connection of
	// the event sockets (0: the kvevents defaults).
	KVMaxMessageBytes  int64
	KVHandshakeTimeout time.Duration

	Gossip gossip.Config // Name is filled from Name

	Listen         string        // status/metrics HTTP address; "" disables
	ScrapeInterval time.Duration // health + metrics (default 200 ms)
	ModelsInterval time.Duration // /v1/models refresh (default 30 s)
	FilterFPR      float64       // target false-positive rate (default 0.01)
	// Capacity is the engine's KV capacity in blocks (default 65536): it
	// sizes the filter, and bounds the exact set until the engine reports
	// its own (vLLM's num_gpu_blocks), which then rules. New refuses one
	// whose filter is too big for gossip to carry (bloom.MaxCapacity).
	Capacity int
	// ResidentSlack is how far past the engine's capacity the exact set
	// may grow, as a fraction of it (default 0.25), before it refuses
	// stores: room for a capacity stated a little low, and for blocks an
	// engine's connector reports without a medium that live on another
	// tier. An honest engine never needs more.
	ResidentSlack float64
	// OffloadCapacity is the engine's offload tier in blocks (vLLM's
	// OffloadingConnector or LMCache holding blocks in host memory; 0:
	// none, and blocks on media other than GPU are ignored). Blocks held
	// only there are published under tier-salted keys (residentset's
	// Options.Offload) so that routers price a hit there as a load; the
	// exact set and the filter are sized for GPU and offload blocks
	// together, the filter never past what gossip carries.
	OffloadCapacity int
	// OffloadMedia names the offload tiers followed, the cheapest to load
	// from first (default CPU, the medium vLLM's OffloadingConnector
	// publishes); used only with OffloadCapacity.
	OffloadMedia []string
	// MaxKVGroups bounds the KV-cache groups (group_idx) followed (default
	// residentset.DefaultMaxGroups).
	MaxKVGroups int
	// LoRANames names LoRA adapters by the numeric id vLLM before v0.14
	// sends alone in its events (routers key adapters by name).
	LoRANames map[int64]string

	// DataParallel is set when the engine server at EngineURL runs
	// data-parallel ranks (one HTTP server, a KV cache and event stream
	// per rank) and this sidecar follows rank DataParallelRank: it reads
	// that rank's samples of /metrics, refuses event batches stamped with
	// another rank, and announces the rank so that routers name it
	// (X-data-parallel-rank) on every request they send here. The server
	// is known by EngineURL, which all its ranks' sidecars share.
	DataParallel     bool
	DataParallelRank int
	// KVRole is the engine's side of prefill/decode disaggregation,
	// announced so that routers send it prefills (KVPrefill), decodes of
	// remote prefills (KVDecode) or whole requests (KVBoth).
	KVRole fleet.KVRole

	Logger zerolog.Logger
}

// ParseLoRAIDs parses "NAME=ID,NAME=ID" (--lora-ids) into names by id.
func ParseLoRAIDs(spec string) (map[int64]string, error) {
	out := map[int64]string{}
	for _, item := range strings.Split(spec, ",") {
		if item = strings.TrimSpace(item); item == "" {
			continue
		}
		name, idText, ok := strings.Cut(item, "=")
		id, err := strconv.ParseInt(strings.TrimSpace(idText), 10, 64)
		if name = strings.TrimSpace(name); !ok || name == "" || err != nil || id <= 0 {
			return nil, fmt.Errorf("sidecar: --lora-ids: %q is not NAME=ID with a positive integer ID", item)
		}
		if prev, dup := out[id]; dup && prev != name {
			return nil, fmt.Errorf("sidecar: --lora-ids: id %d named both %q and %q", id, prev, name)
		}
		out[id] = name
	}
	return out, nil
}

// Sidecar is one running sidecar.
type Sidecar struct {
	cfg    Config
	log    zerolog.Logger
	client *http.Client
	// modelsLog is log at most once a minute: while the engine refuses
	// /v1/models it is asked every scrape interval. overfullLog too: an
	// engine may fill the set again after every clear.
	modelsLog, overfullLog zerolog.Logger
	// maxFilterKeys is the largest filter gossip can carry at FilterFPR:
	// rebuilds never grow a filter past it.
	maxFilterKeys int

	// mu guards the exact set and the filter: the event goroutine applies
	// batches, the maintenance goroutine rebuilds.
	mu      sync.Mutex
	set     *residentset.Set
	gens    *bloom.Generations
	obs     observer
	resets  uint64
	reasons []string

	// Set once Run has started them; read by Status from any goroutine.
	node atomic.Pointer[gossip.SidecarNode]
	sub  atomic.Pointer[kvevents.Subscriber]

	healthy   atomic.Bool
	metricsOK atomic.Bool
	// engineBlocks is the capacity the engine reports (0: not said).
	engineBlocks atomic.Int64
	load         atomic.Pointer[EngineMetrics]
	models       atomic.Pointer[[]string]
	blockSize    atomic.Int64
	scrapeErrs   atomic.Uint64
	// metricsReadNanos is how long the last /metrics read took.
	metricsReadNanos atomic.Int64
	rebuilds         atomic.Uint64
	clearReq         chan struct{}
	rebuildReq       chan struct{}
	keysBuf          []uint64   // the exact set copied for a rebuild; maintain goroutine only
	announceMu       sync.Mutex // one metadata announcement at a time

	// releaseNext is set when a batch was outsized: the decode of the next
	// drops its buffers, and then they are handed back to the OS at once
	// rather than at the runtime's next forced GC minutes later. Event
	// goroutine only; releasing guards against overlapping releases.
	releaseNext bool
	releasing   atomic.Bool

	// eventsRank is the data_parallel_rank of the last batch that carried
	// one, plus one (0: none yet); rankMismatches counts the batches
	// refused for another rank than DataParallelRank.
	eventsRank     atomic.Int64
	rankMismatches atomic.Uint64
	// rankLog is log at most once a minute: a misconfigured rank
	// mismatches every batch.
	rankLog zerolog.Logger

	httpSrv *http.Server
	// accepts is the status listener, once listening.
	accepts atomic.Pointer[listener.Guarded]
}

// serveHTTP serves status and metrics through a listener that rides out
// accept errors (counted in accept_errors) rather than net/http's, which
// retries too but counts nothing.
func (s *Sidecar) serveHTTP() error {
	ln, err := net.Listen("tcp", s.cfg.Listen)
	if err != nil {
		return err
	}
	g := listener.Guard(ln, s.log)
	s.accepts.Store(g)
	return s.httpSrv.Serve(g)
}

// observer forwards resident-set changes to the current generations.
type observer struct{ g *bloom.Generations }

func (o observer) Added(k uint64)   { o.g.Add(k) }
func (o observer) Removed(k uint64) { o.g.Remove(k) }
func (o observer) Cleared()         { o.g.Clear() }

func (c *Config) withDefaults() error {
	if c.Name == "" {
		return errors.New("sidecar: --name is required")
	}
	if c.EngineURL == "" {
		return errors.New("sidecar: --engine is required")
	}
	c.EngineURL = strings.TrimRight(c.EngineURL, "/")
	if c.Protocol == "" {
		c.Protocol = "vllm"
	}
	if _, ok := protocolMetrics[c.Protocol]; !ok {
		return fmt.Errorf("sidecar: --protocol %q: want vllm or sglang", c.Protocol)
	}
	if c.KVEvents != "" && c.KVEventsBind != "" {
		return errors.New("sidecar: give --kv-events or --kv-events-bind, not both")
	}
	if c.ScrapeInterval <= 0 {
		c.ScrapeInterval = 200 * time.Millisecond
	}
	if c.ModelsInterval <= 0 {
		c.ModelsInterval = 30 * time.Second
	}
	if c.FilterFPR <= 0 || c.FilterFPR >= 1 {
		c.FilterFPR = 0.01
	}
	if c.Capacity <= 0 {
		c.Capacity = 1 << 16
	}
	if c.ResidentSlack <= 0 {
		c.ResidentSlack = 0.25
	}
	if c.MaxKVGroups <= 0 {
		c.MaxKVGroups = residentset.DefaultMaxGroups
	}
	if c.OffloadCapacity < 0 {
		return fmt.Errorf("sidecar: --offload-capacity %d: want blocks ≥ 0", c.OffloadCapacity)
	}
	if c.OffloadCapacity == 0 {
		c.OffloadMedia = nil
	} else {
		var err error
		if c.OffloadMedia, err = offloadMedia(c.OffloadMedia); err != nil {
			return err
		}
	}
	if c.DataParallel && (c.DataParallelRank < 0 || c.DataParallelRank > filterstream.MaxDataParallelRank) {
		return fmt.Errorf("sidecar: --data-parallel-rank %d: want 0..%d", c.DataParallelRank, filterstream.MaxDataParallelRank)
	}
	c.Gossip.Name = c.Name
	c.Gossip.Logger = c.Logger.With().Str("part", "gossip").Logger()
	return nil
}

// New checks cfg and prepares a sidecar; Run starts it.
func New(cfg Config) (*Sidecar, error) {
	if err := cfg.withDefaults(); err != nil {
		return nil, err
	}
	maxKeys := bloom.MaxCapacity(cfg.FilterFPR, filterstream.MaxFilterPayload)
	if cfg.Capacity > maxKeys {
		blocks, _ := bloom.Params(uint(cfg.Capacity), cfg.FilterFPR)
		size := bloom.SnapshotSize(uint(blocks) * 512)
		return nil, fmt.Errorf("sidecar: --capacity %d needs a filter of %d bytes (%.1f MiB) at --filter-fpr %g, over the %d a gossip message carries: "+
			"no router would ever receive it; the largest --capacity at this rate is %d (a higher --filter-fpr allows more)",
			cfg.Capacity, size, float64(size)/(1<<20), cfg.FilterFPR, filterstream.MaxFilterPayload, maxKeys)
	}
	sampled := func() zerolog.Logger { return cfg.Logger.Sample(&zerolog.BurstSampler{Burst: 1, Period: time.Minute}) }
	s := &Sidecar{
		cfg:           cfg,
		log:           cfg.Logger,
		modelsLog:     sampled(),
		overfullLog:   sampled(),
		rankLog:       sampled(),
		maxFilterKeys: maxKeys,
		client:        &http.Client{Timeout: 2 * time.Second},
		set: residentset.New(residentset.Options{LoRANames: cfg.LoRANames, Offload: cfg.OffloadMedia,
			MaxBlocks: withSlack(cfg.Capacity+cfg.OffloadCapacity, cfg.ResidentSlack), MaxGroups: cfg.MaxKVGroups}),
		clearReq: make(chan struct{}, 1), rebuildReq: make(chan struct{}, 1),
	}
	s.gens = s.newGenerations(time.Now(), 1)
	s.obs = observer{s.gens}
	s.load.Store(&EngineMetrics{})
	empty := []string{}
	s.models.Store(&empty)
	return s, nil
}

// withSlack is the most blocks the exact set holds for an engine of
// capacity blocks.
func withSlack(capacity int, slack float64) int {
	return capacity + int(math.Ceil(float64(capacity)*slack))
}

func (s *Sidecar) kvEvents() bool { return s.cfg.KVEvents != "" || s.cfg.KVEventsBind != "" }

func (s *Sidecar) newGenerations(now time.Time, first uint64) *bloom.Generations {
	return bloom.NewGenerations(bloom.GenerationConfig{
		Capacity:        min(s.cfg.Capacity+s.cfg.OffloadCapacity, s.maxFilterKeys),
		MaxKeys:         s.maxFilterKeys,
		FPRate:          s.cfg.FilterFPR,
		MaxDeltaKeys:    150, // one delta per ~1.3 KB datagram
		FirstGeneration: first,
	}, rand.Uint64()|1, now)
}

// Run starts every part and blocks until ctx ends, then leaves the cluster
// gracefully (routers drop this replica at once) and stops.
func (s *Sidecar) Run(ctx context.Context) error {
	// Learn what the engine serves before announcing it, but do not wait
	// for a slow engine: the scrape loop keeps trying.
	s.checkHealth(ctx)
	s.refreshModels(ctx)
	if s.healthy.Load() {
		// The block size, where the engine's metrics tell it, goes out
		// with the first announcement: routers ignore a filter until they
		// know the size of the blocks behind its keys.
		s.readMetrics(ctx)
	}

	scfg := gossip.SidecarConfig{
		Config:        s.cfg.Gossip,
		Models:        *s.models.Load(),
		BlockSize:     int(s.blockSize.Load()),
		EngineURL:     s.cfg.EngineURL,
		Protocol:      s.cfg.Protocol,
		OnClearRoutes: s.requestClear,

		DataParallel:     s.cfg.DataParallel,
		DataParallelRank: s.cfg.DataParallelRank,
		OffloadMedia:     s.cfg.OffloadMedia,
		KVRole:           uint8(s.cfg.KVRole),
	}
	if s.kvEvents() {
		scfg.Filter = s.gens
	}
	node, err := gossip.StartSidecar(scfg)
	if err != nil {
		return err
	}
	s.node.Store(node)
	s.pushLoad()

	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 3)
	if s.kvEvents() {
		ep, bind := s.cfg.KVEvents, false
		if ep == "" {
			ep, bind = s.cfg.KVEventsBind, true
		}
		sub := kvevents.NewSubscriber(kvevents.SubscriberConfig{
			Endpoint: ep, Bind: bind, ReplayEndpoint: s.cfg.KVReplay, Topic: s.cfg.KVTopic,
			MaxMessageBytes: s.cfg.KVMaxMessageBytes, HandshakeTimeout: s.cfg.KVHandshakeTimeout,
			Logger: s.log.With().Str("part", "kvevents").Logger(),
		}, s)
		s.sub.Store(sub)
		wg.Add(2)
		go func() {
			defer wg.Done()
			if err := sub.Run(ctx); err != nil {
				errc <- err
			}
		}()
		go func() { defer wg.Done(); s.maintain(ctx) }()
	}
	wg.Add(1)
	go func() { defer wg.Done(); s.scrape(ctx) }()
	if s.cfg.Listen != "" {
		s.httpSrv = &http.Server{Addr: s.cfg.Listen, Handler: s.Handler(), ReadHeaderTimeout: 5 * time.Second}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.serveHTTP(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("sidecar: --listen %s: %w", s.cfg.Listen, err)
			}
		}()
	}
	s.log.Info().Str("version", buildinfo.Version()).Str("name", s.cfg.Name).Str("gossip", node.Addr()).Str("engine", s.cfg.EngineURL).
		Bool("kv_events", s.kvEvents()).Msg("sidecar running")

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errc:
	}
	// Leave first: routers stop sending here before anything else stops.
	s.healthy.Store(false)
	s.pushLoad()
	if err := node.Leave(2 * time.Second); err != nil {
		s.log.Warn().Err(err).Msg("leave")
	}
	cancel()
	if s.httpSrv != nil {
		sctx, c := context.WithTimeout(context.Background(), time.Second)
		_ = s.httpSrv.Shutdown(sctx)
		c()
	}
	wg.Wait()
	return runErr
}

// applyChunk is how many events HandleBatch applies per hold of the lock,
// so that /status and rebuilds never wait for a whole outsized batch.
const applyChunk = 1024

// HandleBatch applies one batch of KV events (kvevents.Handler), unless
// it is stamped with another data-parallel rank than the one followed.
func (s *Sidecar) HandleBatch(seq uint64, b *kvevents.Batch) {
	if !s.ownRank(b.DPRank) {
		return
	}
	s.mu.Lock()
	wasOverfull := s.set.Overfull()
	for i := range b.Events {
		if i > 0 && i%applyChunk == 0 {
			s.mu.Unlock()
			s.mu.Lock()
		}
		s.set.Apply(&b.Events[i], s.obs)
	}
	s.setBlockSizeLocked(s.set.BlockSize())
	rebuild := s.gens.NeedsRebuild(time.Now())
	becameOverfull := s.set.Overfull() && !wasOverfull
	var limit int
	if becameOverfull {
		limit = s.residentLimitLocked()
	}
	s.mu.Unlock()
	if s.releaseNext && s.releasing.CompareAndSwap(false, true) {
		go func() { debug.FreeOSMemory(); s.releasing.Store(false) }()
	}
	s.releaseNext = b.Outsized()
	if becameOverfull {
		s.overfullLog.Warn().Int("resident_limit", limit).Int64("engine_capacity", s.engineBlocks.Load()).
			Msg("engine claims more resident blocks than its capacity allows (events lost, or not the engine): further stores refused until it removes some")
	}
	if rebuild {
		// Not here: event intake must not wait for a filter to be filled.
		select {
		case s.rebuildReq <- struct{}{}:
		default:
		}
	}
}

// ownRank reports whether a batch stamped with data-parallel rank (-1:
// none) describes the cache this sidecar follows. A batch of another rank
// is refused, counted and logged: its blocks are in a cache that requests
// routed here, which name this sidecar's rank, never reach (the sidecar
// is connected to another rank's port, or given the wrong rank). Without
// --data-parallel-rank every batch is applied; one stamped with a rank
// over 0 says the engine is data-parallel, which is logged.
func (s *Sidecar) ownRank(rank int) bool {
	if rank < 0 {
		return true
	}
	s.eventsRank.Store(int64(rank) + 1)
	switch {
	case s.cfg.DataParallel && rank != s.cfg.DataParallelRank:
		s.rankMismatches.Add(1)
		s.rankLog.Warn().Int("data_parallel_rank", s.cfg.DataParallelRank).Int("events_data_parallel_rank", rank).
			Msg("KV event batch of another data-parallel rank refused: --kv-events must be the port of this sidecar's rank (the engine's port plus the rank)")
		return false
	case !s.cfg.DataParallel && rank > 0:
		s.rankLog.Warn().Int("events_data_parallel_rank", rank).
			Msg("KV events come from a data-parallel rank: if the engine's ranks share one HTTP server, give --data-parallel-rank so that routers send requests to the rank whose cache this sidecar follows")
	}
	return true
}

// HandleReset drops everything learned from the lost stream
// (kvevents.Handler): the engine restarted, or a gap could not be replayed.
// Routers get an empty filter under a new epoch at once.
func (s *Sidecar) HandleReset(reason string) {
	s.mu.Lock()
	s.set.Reset(nil)
	s.gens = s.newGenerations(time.Now(), s.gens.Snapshot().Generation+1)
	s.obs = observer{s.gens}
	s.resets++
	s.reasons = append(s.reasons, reason)
	if len(s.reasons) > 8 {
		s.reasons = s.reasons[1:]
	}
	g := s.gens
	s.mu.Unlock()
	s.log.Warn().Str("reason", reason).Msg("KV event stream reset: resident set cleared, new filter epoch")
	if n := s.node.Load(); n != nil {
		n.SetFilter(g)
	}
}

// rebuild publishes a new filter generation from the exact set (when one is
// due, or always if force). The set's lock is held only to copy the keys and
// to install the result; filling the filter (≈20 ms at 300k keys) runs
// outside it, and the events applied meanwhile are carried over.
func (s *Sidecar) rebuild(now time.Time, force bool) {
	s.mu.Lock()
	g := s.gens
	if !force && !g.NeedsRebuild(now) {
		s.mu.Unlock()
		return
	}
	s.keysBuf = s.set.AppendKeys(s.keysBuf[:0])
	job := g.BeginRebuild()
	s.mu.Unlock()

	job.Build(slices.Values(s.keysBuf))

	s.mu.Lock()
	installed := s.gens == g && g.Install(now, job) // an engine reset replaced g: drop
	s.mu.Unlock()
	if installed {
		s.rebuilds.Add(1)
	}
	if cap(s.keysBuf) > 4<<20 { // do not keep a huge copy between rebuilds
		s.keysBuf = nil
	}
}

func (s *Sidecar) requestClear() {
	select {
	case s.clearReq <- struct{}{}:
	default:
	}
}

// maintain rebuilds generations (when due, checked every second and when
// event intake asks) and serves route clears.
func (s *Sidecar) maintain(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	var lastClear time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.rebuild(time.Now(), false)
		case <-s.rebuildReq:
			s.rebuild(time.Now(), false)
		case <-s.clearReq:
			// A router cleared this replica's routes: publish the exact set
			// afresh (no stale positives). At most once a second, but never
			// dropped: routers wait for a generation newer than the clear.
			if wait := time.Second - time.Since(lastClear); wait > 0 {
				select {
				case <-ctx.Done():
					return
				case <-time.After(wait):
				}
			}
			lastClear = time.Now()
			s.rebuild(lastClear, true)
		}
	}
}

// scrape health-checks the engine and reads its metrics every interval.
// Every interval, however long /metrics takes to render: spacing slow reads
// out was tried, and a load record left stale sent warm prompts away from
// their replica on a loaded machine (a queue seen late is worse than a few
// ms of the engine's time). How long reads take is exported instead
// (kvmesh_sidecar_engine_metrics_read_seconds), for operators to see.
func (s *Sidecar) scrape(ctx context.Context) {
	t := time.NewTicker(s.cfg.ScrapeInterval)
	defer t.Stop()
	lastModels := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		was := s.healthy.Load()
		s.checkHealth(ctx)
		if s.healthy.Load() {
			start := time.Now()
			s.readMetrics(ctx)
			s.metricsReadNanos.Store(int64(time.Since(start)))
			if len(*s.models.Load()) == 0 || time.Since(lastModels) > s.cfg.ModelsInterval || !was {
				lastModels = time.Now()
				if s.refreshModels(ctx) {
					s.announce()
				}
			}
		}
		s.pushLoad()
	}
}

func (s *Sidecar) get(ctx context.Context, path string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, max(s.cfg.ScrapeInterval*4, time.Second))
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.cfg.EngineURL+path, nil)
	if err != nil {
		return nil, err
	}
	if s.cfg.EngineAPIKey != "" {
		req.Header.Set("Authorization", "Bearer "+s.cfg.EngineAPIKey)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return body, &statusError{path: path, status: resp.StatusCode}
	}
	return body, nil
}

// statusError is an engine's answer other than 200.
type statusError struct {
	path   string
	status int
}

func (e *statusError) Error() string {
	msg := fmt.Sprintf("GET %s: %d %s", e.path, e.status, http.StatusText(e.status))
	if e.status == http.StatusUnauthorized || e.status == http.StatusForbidden {
		msg += " (engine started with --api-key? give the sidecar --engine-api-key)"
	}
	return msg
}

func (s *Sidecar) checkHealth(ctx context.Context) {
	_, err := s.get(ctx, "/health")
	ok := err == nil
	if s.healthy.Swap(ok) != ok {
		if ok {
			s.log.Info().Msg("engine healthy")
		} else {
			s.log.Warn().Err(err).Msg("engine unhealthy: announced offline")
		}
	}
}

func (s *Sidecar) readMetrics(ctx context.Context) {
	body, err := s.get(ctx, "/metrics")
	if err == nil {
		var m EngineMetrics
		if m, err = s.parseMetrics(body); err == nil {
			s.load.Store(&m)
			s.metricsOK.Store(true)
			s.configuredBlockSize(m.BlockSize)
			s.engineCapacity(m.CapacityBlocks)
			return
		}
	}
	if s.metricsOK.Swap(false) {
		s.log.Warn().Err(err).Msg("engine metrics unreadable")
	}
	s.scrapeErrs.Add(1)
}

// parseMetrics reads the load figures of the rank followed, or of the
// whole engine when it is not data-parallel.
func (s *Sidecar) parseMetrics(body []byte) (EngineMetrics, error) {
	if s.cfg.DataParallel {
		return ParseRankMetrics(body, s.cfg.Protocol, s.cfg.DataParallelRank)
	}
	return ParseMetrics(body, s.cfg.Protocol)
}

// residentLimitLocked is the most blocks the exact set holds: the engine's
// own capacity when it reports one, else --capacity, with slack (s.mu held).
func (s *Sidecar) residentLimitLocked() int {
	c := int(s.engineBlocks.Load())
	if c <= 0 {
		c = s.cfg.Capacity
	}
	return withSlack(c+s.cfg.OffloadCapacity, s.cfg.ResidentSlack)
}

// offloadMedia normalises --offload-media: upper case, no repeats, CPU
// when none is named, at most filterstream.MaxOffloadMedia.
func offloadMedia(media []string) ([]string, error) {
	var out []string
	for _, m := range media {
		if m = strings.ToUpper(strings.TrimSpace(m)); m != "" && m != "GPU" && !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	if len(out) == 0 {
		out = []string{"CPU"}
	}
	if len(out) > filterstream.MaxOffloadMedia {
		return nil, fmt.Errorf("sidecar: --offload-media: %d media, at most %d", len(out), filterstream.MaxOffloadMedia)
	}
	return out, nil
}

// engineCapacity bounds the exact set by the capacity the engine reports
// (0: it does not say), and warns when filters are sized for less.
func (s *Sidecar) engineCapacity(blocks int) {
	if blocks <= 0 || s.engineBlocks.Swap(int64(blocks)) == int64(blocks) {
		return
	}
	s.mu.Lock()
	limit := s.residentLimitLocked()
	s.set.SetMaxBlocks(limit)
	s.mu.Unlock()
	ev := s.log.Info()
	msg := "engine capacity known: the exact set holds at most resident_limit blocks"
	switch {
	case blocks > s.maxFilterKeys:
		ev = s.log.Warn()
		msg = "engine holds more blocks than a filter gossip can carry at --filter-fpr: past max_filter_keys the false-positive rate rises above target"
	case blocks > s.cfg.Capacity:
		ev = s.log.Warn()
		msg = "engine holds more blocks than --capacity: filters grow on rebuild to fit; set --capacity to the engine's to size them from the start"
	}
	ev.Int("engine_capacity", blocks).Int("capacity", s.cfg.Capacity).Int("resident_limit", limit).Int("max_filter_keys", s.maxFilterKeys).Msg(msg)
}

// configuredBlockSize takes the block size of the engine's configuration
// until KV events tell it (they rule: a hybrid model's events may carry
// another), so that routers can match prefixes from the first filter on.
func (s *Sidecar) configuredBlockSize(bs int) {
	s.mu.Lock()
	if s.set.BlockSize() == 0 {
		s.setBlockSizeLocked(bs)
	}
	s.mu.Unlock()
}

// setBlockSizeLocked keeps the block size routers key prompts with and
// announces a change (s.mu held). A metadata update waits for its
// broadcast: neither event intake nor the scrape loop waits with it.
func (s *Sidecar) setBlockSizeLocked(bs int) {
	if bs > 0 && int64(bs) != s.blockSize.Load() {
		s.blockSize.Store(int64(bs))
		go s.announce()
	}
}

// refreshModels reads /v1/models and reports whether the list changed.
func (s *Sidecar) refreshModels(ctx context.Context) bool {
	body, err := s.get(ctx, "/v1/models")
	if err != nil {
		if _, refused := err.(*statusError); refused {
			s.modelsLog.Warn().Err(err).Msg("engine refuses to list its models")
		}
		return false
	}
	models, err := ParseModels(body)
	if err != nil {
		s.modelsLog.Warn().Err(err).Msg("engine's model list unreadable")
		return false
	}
	if slices.Equal(models, *s.models.Load()) {
		return false
	}
	s.models.Store(&models)
	s.log.Info().Strs("models", models).Msg("engine serves")
	return true
}

// announce puts the current models and block size in the node metadata,
// retrying (bounded) while the cluster does not confirm the broadcast:
// routers ignore a filter until they know the block size behind its keys.
func (s *Sidecar) announce() {
	n := s.node.Load()
	if n == nil {
		return
	}
	s.announceMu.Lock()
	defer s.announceMu.Unlock()
	for attempt := 1; ; attempt++ {
		err := n.SetModels(*s.models.Load(), int(s.blockSize.Load()))
		if err == nil {
			return
		}
		if attempt == 10 {
			s.log.Warn().Err(err).Int("attempts", attempt).Msg("metadata update not confirmed; gossip will carry it")
			return
		}
		s.log.Debug().Err(err).Int("attempt", attempt).Msg("metadata update not confirmed; retrying")
		time.Sleep(500 * time.Millisecond)
	}
}

func (s *Sidecar) pushLoad() {
	n := s.node.Load()
	if n == nil {
		return
	}
	m := s.load.Load()
	n.SetEngineLoad(gossip.EngineLoad{Healthy: s.healthy.Load(), Waiting: m.Waiting, Running: m.Running, KVUsage: m.KVUsage})
}

// KVRoleOf is the role to announce: role when named (--kv-role), else the
// kv_role of the engine's --kv-transfer-config JSON, else both. vLLM's
// NixlConnector deployments often run both sides as kv_both, so only
// --kv-role can tell a prefill pool from a decode pool there.
func KVRoleOf(role, transferConfig string) (fleet.KVRole, error) {
	if role != "" {
		return fleet.ParseKVRole(role)
	}
	if transferConfig == "" {
		return fleet.KVBoth, nil
	}
	var tc struct {
		KVRole *string `json:"kv_role"`
	}
	if err := json.Unmarshal([]byte(transferConfig), &tc); err != nil {
		return fleet.KVBoth, fmt.Errorf("sidecar: --kv-transfer-config: %w", err)
	}
	if tc.KVRole == nil {
		return fleet.KVBoth, nil
	}
	r, err := fleet.ParseKVRole(*tc.KVRole)
	if err != nil {
		return fleet.KVBoth, fmt.Errorf("sidecar: --kv-transfer-config: %w", err)
	}
	return r, nil
}
