// Package router runs one kvmesh router: it builds the fleet table and the
// gateway from the settings and the config file, joins the gossip cluster,
// serves the API until its context ends, then drains. cmd/router turns
// flags into a Config; everything the process does lives here.
package router

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/pprofhandler"

	"github.com/kvmesh/kvmesh/buildinfo"
	"github.com/kvmesh/kvmesh/certfile"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gateway"
	"github.com/kvmesh/kvmesh/gossip"
	"github.com/kvmesh/kvmesh/listener"
	"github.com/kvmesh/kvmesh/routerconfig"
)

// Config is everything a router needs.
type Config struct {
	Listen string // HTTP address: the OpenAI API, and the rest without AdminListen
	// AdminListen, when set, serves /admin/*, the console and /metrics
	// alone, and Listen answers them 404.
	AdminListen string
	// Name is the router's name in the cluster (default: host name and
	// Listen's port).
	Name string
	// Gossip joins the cluster; with neither BindAddr nor Join the router
	// runs without gossip, on static upstreams only. BindAddr defaults to
	// 127.0.0.1:0 when only Join is given. Name and Logger are filled in.
	Gossip gossip.Config
	// Flags are the routing settings the config file overlays.
	Flags routerconfig.Flags
	// ConfigPath is the YAML config file, reloaded on change ("": none);
	// ConfigMaxBytes bounds what is read of it and ConfigSettle is how long
	// a change must stay the same before it applies.
	ConfigPath     string
	ConfigMaxBytes int64
	ConfigSettle   time.Duration
	// AdminToken guards /admin/routes/clear; AdminOpen serves it without
	// one (else, without a token, it is refused).
	AdminToken string
	AdminOpen  bool
	// EngineAPIKey is sent to every replica instead of the client's
	// Authorization.
	EngineAPIKey string
	// NoDataParallelHeader withholds X-data-parallel-rank from requests to
	// data-parallel ranks (gateway.Settings.NoDataParallelHeader).
	NoDataParallelHeader bool
	// IgnoreTiers matches GPU blocks only (gateway.Settings.IgnoreTiers).
	IgnoreTiers bool
	// CarryStoredState has stored responses' ids carry their follow-ups'
	// prediction (gateway.Settings.CarryStoredState).
	CarryStoredState bool
	MaxBodyBytes     int
	// PprofListen serves Go profiles ("": off).
	PprofListen string
	// TLSCert and TLSKey, both or neither, serve HTTPS; renewed files are
	// picked up within 10 s.
	TLSCert, TLSKey string
	// On shutdown the router answers /ready with 503 but serves on for
	// ShutdownDelay, then lets in-flight requests finish for DrainTimeout.
	ShutdownDelay, DrainTimeout time.Duration
	// OrphanProbe is how often the engine of a replica whose sidecar failed
	// is asked for /health; OrphanForget forgets it after not answering
	// that long.
	OrphanProbe, OrphanForget time.Duration

	Logger zerolog.Logger
}

func (c *Config) check() error {
	switch {
	case c.MaxBodyBytes <= 0:
		return errors.New("--max-body-bytes must be positive")
	case c.ConfigMaxBytes <= 0 || c.ConfigSettle <= 0:
		return errors.New("--config-max-bytes and --config-settle must be positive")
	case c.AdminOpen && c.AdminToken != "":
		return errors.New("--admin-open and --admin-token exclude each other: the token would guard the clear anyway")
	case (c.TLSCert == "") != (c.TLSKey == ""):
		return errors.New("--tls-cert and --tls-key go together")
	case c.OrphanProbe <= 0 || c.OrphanForget <= 0:
		return errors.New("--orphan-probe-interval and --orphan-forget-after must be positive")
	}
	return nil
}

// Run serves until ctx ends, then stops being ready, drains and leaves the
// cluster. It returns early with the error that kept it from serving.
func Run(ctx context.Context, cfg Config) error {
	if err := cfg.check(); err != nil {
		return err
	}
	log := cfg.Logger
	base, err := routerconfig.FromFlags(cfg.Flags)
	if err != nil {
		return err
	}
	table := fleet.NewTable(fleet.TableConfig{ForgetOrphanAfter: cfg.OrphanForget})
	builder := &routerconfig.Builder{Table: table, AdminToken: cfg.AdminToken, AdminOpen: cfg.AdminOpen, EngineAPIKey: cfg.EngineAPIKey,
		NoDataParallelHeader: cfg.NoDataParallelHeader, IgnoreTiers: cfg.IgnoreTiers, CarryStoredState: cfg.CarryStoredState, Log: log}
	rc := base
	if cfg.ConfigPath != "" {
		file, err := routerconfig.Load(cfg.ConfigPath, cfg.ConfigMaxBytes, cfg.ConfigSettle)
		if err != nil {
			return err
		}
		rc = routerconfig.Overlay(base, file)
	}
	settings, err := builder.Build(rc)
	if err != nil {
		return err
	}
	g := gateway.New(table, nil, settings, log)
	reloader := &routerconfig.Reloader{Base: base, Path: cfg.ConfigPath, Builder: builder, Gateway: g, Log: log,
		MaxBytes: cfg.ConfigMaxBytes, Settle: cfg.ConfigSettle}
	if err := g.RegisterMetrics(reloader); err != nil {
		return err
	}
	if err := builder.Apply(g, rc); err != nil {
		return err
	}
	stop := ctx.Done()

	// drained closes once no request is left: until then the other routers
	// must still see this one's in-flight work on each replica.
	drained := make(chan struct{})
	drainedNow := sync.OnceFunc(func() { close(drained) })
	defer drainedNow()
	var node *gossip.RouterNode
	if cfg.Gossip.BindAddr != "" || len(cfg.Gossip.Join) > 0 {
		if node, err = startGossip(&cfg, table, g); err != nil {
			return err
		}
		g.SetCluster(node)
		if err := g.RegisterMetrics(gossip.Collector("kvmesh_router", node.Stats)); err != nil {
			return err
		}
		go g.ReportInflight(20*time.Millisecond, drained)
		go g.ReportTenantUsage(gateway.UsageReportEvery, drained)
		go g.ProbeOrphans(cfg.OrphanProbe, min(cfg.OrphanProbe, 2*time.Second), stop)
	}
	go g.DiscoverStatic(10*time.Second, stop)
	go g.ForgetDeparted(time.Minute, 10*time.Minute, stop)
	if cfg.ConfigPath != "" {
		if err := reloader.Watch(ctx, func() { go g.RefreshStaticModels() }); err != nil {
			log.Warn().Err(err).Msg("config file not watched: changes need a restart")
		}
	}

	var certs *certfile.Source
	if cfg.TLSCert != "" {
		if certs, err = certfile.Load(cfg.TLSCert, cfg.TLSKey, 10*time.Second); err != nil {
			return err
		}
	}
	// listen serves HTTPS on the admin listener too: it carries the admin token.
	listen := func(addr, name string) (net.Listener, error) {
		ln, err := guardedListen(addr, name, g, log)
		if err != nil || certs == nil {
			return ln, err
		}
		return tls.NewListener(ln, certs.Config()), nil
	}
	ln, err := listen(cfg.Listen, "api")
	if err != nil {
		return err
	}
	if cfg.PprofListen != "" {
		if pln, err := guardedListen(cfg.PprofListen, "pprof", g, log); err != nil {
			log.Warn().Err(err).Msg("pprof server")
		} else {
			go func() { _ = fasthttp.Serve(pln, pprofhandler.PprofHandler) }()
		}
	}
	srv := g.Server(cfg.MaxBodyBytes)
	var adminSrv *fasthttp.Server
	served := make(chan error, 2)
	if cfg.AdminListen != "" {
		aln, err := listen(cfg.AdminListen, "admin")
		if err != nil {
			_ = ln.Close()
			return err
		}
		srv, adminSrv = g.Servers(cfg.MaxBodyBytes)
		go func() { served <- adminSrv.Serve(aln) }()
	}
	go func() { served <- srv.Serve(ln) }()
	log.Info().Str("version", buildinfo.Version()).Str("listen", ln.Addr().String()).Str("admin_listen", cfg.AdminListen).
		Bool("tls", cfg.TLSCert != "").Str("policy", g.Settings().Policy.Name()).
		Bool("gossip", node != nil).Msg("router ready")

	select {
	case err := <-served:
		return err
	case <-stop:
	}
	g.Stopping()
	if cfg.ShutdownDelay > 0 {
		log.Info().Dur("shutdown_delay", cfg.ShutdownDelay).Msg("shutting down: not ready, still serving")
		time.Sleep(cfg.ShutdownDelay)
	}
	log.Info().Int("inflight", g.Inflight()).Dur("drain_timeout", cfg.DrainTimeout).Msg("shutting down: draining")
	drainCtx, cancel := context.WithTimeout(context.Background(), cfg.DrainTimeout)
	defer cancel()
	if err := srv.ShutdownWithContext(drainCtx); err != nil {
		log.Warn().Err(err).Int("inflight", g.Inflight()).Msg("drain timed out")
	}
	drainedNow()
	if adminSrv != nil { // served through the drain: its /ready says 503, its metrics count the drain
		_ = adminSrv.Shutdown()
	}
	if node != nil {
		if err := node.Leave(2 * time.Second); err != nil {
			log.Warn().Err(err).Msg("leaving the cluster")
		}
	}
	log.Info().Msg("stopped")
	return nil
}

// guardedListen listens on addr through a listener that survives accept
// errors (fasthttp's Serve returns on the first one, which at the open-file
// limit would end the router), counted in
// kvmesh_router_accept_errors_total{listener=name}.
func guardedListen(addr, name string, g *gateway.Gateway, log zerolog.Logger) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	guarded := listener.Guard(ln, log)
	if err := g.RegisterAcceptErrors(name, guarded.Errors); err != nil {
		_ = ln.Close()
		return nil, err
	}
	return guarded, nil
}

func startGossip(cfg *Config, table *fleet.Table, g *gateway.Gateway) (*gossip.RouterNode, error) {
	gc := cfg.Gossip
	gc.Name = cfg.Name
	if gc.Name == "" {
		host, _ := os.Hostname()
		_, port, _ := net.SplitHostPort(cfg.Listen)
		gc.Name = host + ":" + port
	}
	if gc.BindAddr == "" {
		gc.BindAddr = "127.0.0.1:0"
	}
	gc.Logger = cfg.Logger.With().Str("component", "gossip").Logger()
	return gossip.StartRouter(gossip.RouterConfig{Config: gc, OnClearRoutes: g.ClearRecords, OnTenantUsage: g.MergeTenantUsage}, table)
}
