// Package fleetsim simulates a whole kvmesh fleet in simulated time on the
// project's own pure cores: N engines (package engine, as enginesim runs
// it), each with a sidecar (its KV events into residentset, the set's
// changes into bloom generations, a filterstream.Sender), a modelled
// network (delay, jitter, loss) carrying the filter stream to M routers,
// each with its own fleet.Table fed by a filterstream.Receiver, its own
// in-flight accounting and policy instance, and plan.Decide for every
// request. A workload.Workload's requests go to the routers round-robin;
// time to first token is measured in simulated time from a request's
// arrival to the step that produced its first token.
//
// It is a discrete-event simulation: one event heap, no wall clock, no
// goroutines. Every random draw comes from the seed, and every output of
// a state machine that iterates a map is put in order before it draws, so
// the same seed and workload give the same records (on one architecture:
// where Go fuses multiply-adds, float figures may differ in the last bit).
package fleetsim

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/residentset"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

// Config is one simulated run: the fleet, its timings and one policy.
type Config struct {
	Replicas, Routers int
	// Policy is a routing policy name (routing.Names but random, whose
	// draws are not seeded), OracleName or GuessName.
	Policy  string
	Routing routing.Config
	// Engine configures every replica's engine; zero fields take
	// enginesim's defaults (block size 16, 51,200 blocks, 256 sequences,
	// 8,192 batched tokens, 32,768 max model length, engine.DefaultCost).
	Engine  engine.Config
	Network Network
	// DeltaInterval and LoadInterval pace each sidecar's filter deltas
	// (default 25 ms) and load records (100 ms); ScrapeInterval its reads
	// of the engine's load (200 ms); RouterTick each router's receiver
	// (50 ms: expiry, and in-flight reports every other tick).
	DeltaInterval, LoadInterval, ScrapeInterval, RouterTick time.Duration
	// FilterCapacity sizes each sidecar's filter in keys (default 65,536,
	// the sidecar's --capacity default).
	FilterCapacity int
	Seed           uint64
	// Warmup is simulated time before the first arrival, for every
	// router to hear every sidecar (default 1 s).
	Warmup time.Duration
	// Drain bounds the simulated time after the last arrival; requests
	// unfinished by then are errors (default 10 min).
	Drain time.Duration
	// Progress, when set, is called every few thousand requests.
	Progress func(Progress)
}

// Progress is how far a run has got.
type Progress struct {
	Done, Total int
	Sim         time.Duration
}

// Result is a finished run.
type Result struct {
	// Records has one record per workload request, in workload order,
	// times in simulated time (report.Summarize with time scale 1).
	Records []report.Record
	// Degradations counts kvaware's switches into least-load mode, over
	// every router.
	Degradations int
	// Events is the number of events simulated; Steps the engine steps.
	Events, Steps uint64
	// Rebuilds counts filter generations the sidecars rebuilt.
	Rebuilds int
	// Sim is the simulated time the run covered.
	Sim time.Duration
	// Gossip is the filter stream into router-0 while requests arrived;
	// RouterMemory what router-0 holds for the replicas at the end.
	Gossip       Gossip
	RouterMemory RouterMemory
}

const model = "sim"

// base is the instant simulated time 0 stands for: the state machines
// take time.Time, and a zero time.Time means "never" to some of them.
var base = time.Unix(1_000_000_000, 0).UTC()

func (c *Config) withDefaults() error {
	def := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.DeltaInterval, 25*time.Millisecond)
	def(&c.LoadInterval, 100*time.Millisecond)
	def(&c.ScrapeInterval, 200*time.Millisecond)
	def(&c.RouterTick, 50*time.Millisecond)
	def(&c.Warmup, time.Second)
	def(&c.Drain, 10*time.Minute)
	e := &c.Engine
	if e.BlockSize <= 0 {
		e.BlockSize = workload.BlockSize
	}
	if e.KVBlocks <= 0 {
		e.KVBlocks = 51200
	}
	if e.MaxNumSeqs <= 0 {
		e.MaxNumSeqs = 256
	}
	if e.MaxNumBatchedTokens <= 0 {
		e.MaxNumBatchedTokens = 8192
	}
	if e.MaxModelLen <= 0 {
		e.MaxModelLen = 32768
	}
	if e.Cost == (engine.CostProfile{}) {
		e.Cost = engine.DefaultCost
	}
	if c.FilterCapacity <= 0 {
		c.FilterCapacity = 1 << 16
	}
	switch {
	case c.Replicas <= 0 || c.Routers <= 0:
		return fmt.Errorf("fleetsim: replicas and routers must be positive (got %d, %d)", c.Replicas, c.Routers)
	case c.Policy == "random":
		return errors.New("fleetsim: policy random draws from an unseeded source, so no run would repeat; use round-robin")
	case c.Network.Loss < 0 || c.Network.Loss >= 1 || c.Network.Delay < 0 || c.Network.Jitter < 0:
		return fmt.Errorf("fleetsim: want delay, jitter ≥ 0 and 0 ≤ loss < 1 (got %v, %v, %v)", c.Network.Delay, c.Network.Jitter, c.Network.Loss)
	}
	return nil
}

// sim is one run's state.
type sim struct {
	cfg      Config
	w        *workload.Workload
	q        queue
	now      time.Duration
	net      *network
	replicas []*replica
	routers  []*router
	// member names to indexes
	sidecarIdx, routerIdx map[string]int
	replicaIdx            map[string]int // replica name → index
	oracle                *oracle
	settings              plan.Settings

	reqs    []reqState
	prompts promptCache
	done    int
	res     Result
	wire    []byte // countGossip's encoding buffer
	// freeMsgs are handled messages of deliver's, for reuse.
	freeMsgs []*filterstream.Message
	order    []int // sendOrder's answer
}

// reqState is what the simulator follows of one request.
type reqState struct {
	router, replica int
	start           time.Duration
	ttft, e2e       time.Duration
	mode            routing.Mode
	predicted       int
	uncached        int
	cached, output  int
	err             string
	// hashes are the engine block hashes the oracle counts as queued at
	// the replica until the first token.
	hashes []uint64
}

// Run simulates w through a fleet as cfg describes.
func Run(cfg Config, w *workload.Workload) (Result, error) {
	if err := cfg.withDefaults(); err != nil {
		return Result{}, err
	}
	s := &sim{cfg: cfg, w: w, sidecarIdx: map[string]int{}, routerIdx: map[string]int{}, replicaIdx: map[string]int{}}
	if err := s.build(); err != nil {
		return Result{}, err
	}
	s.prompts = newPromptCache(w)
	s.reqs = make([]reqState, len(w.Requests))
	// Arrivals are not queued but taken in workload order (sorted by
	// time), each when it is earlier than the queue's head; they carry the
	// sequence numbers they would have had, queued here all at once, so
	// events of one instant run in the same order, with a heap a
	// workload's size smaller.
	total := len(w.Requests)
	arrivalSeq := s.q.seq
	s.q.seq += uint64(total)
	nextArrival := 0
	deadline := cfg.Warmup + w.Span() + cfg.Drain
	for s.done < total {
		var ev event
		if nextArrival < total {
			ev = event{at: cfg.Warmup + w.Requests[nextArrival].At, seq: arrivalSeq + uint64(nextArrival) + 1, kind: evArrival, a: nextArrival}
		}
		switch {
		case nextArrival < total && (s.q.Len() == 0 || before(&ev, s.q.peek())):
			nextArrival++
		case s.q.Len() > 0:
			ev = s.q.next()
		default:
			ev.at = deadline + 1 // nothing left to happen
		}
		if ev.at > deadline {
			break
		}
		s.now = ev.at
		s.res.Events++
		s.handle(ev)
	}
	s.res.Sim = s.now
	s.res.Gossip.Window = w.Span()
	s.res.RouterMemory = s.routerMemory()
	for _, r := range s.routers {
		if d, ok := r.policy.(routing.Degrader); ok {
			s.res.Degradations += int(d.Degradations())
		}
	}
	for _, r := range s.replicas {
		s.res.Steps += r.eng.Stats().Steps
		s.res.Rebuilds += r.rebuilt
	}
	s.res.Records = s.records()
	return s.res, nil
}

// build makes the replicas and routers and has every member meet every
// other, as memberlist's join does, at time 0.
func (s *sim) build() error {
	cfg := &s.cfg
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x666c656574))
	s.net = newNetwork(cfg.Network, rng.Uint64())
	maxKeys := bloom.MaxCapacity(0.01, filterstream.MaxFilterPayload)
	var engines []*engine.Engine
	var names []string
	for i := range cfg.Replicas {
		eng, err := engine.New(cfg.Engine)
		if err != nil {
			return err
		}
		name, member := fmt.Sprintf("replica-%d", i), fmt.Sprintf("sidecar-%d", i)
		gens := bloom.NewGenerations(bloom.GenerationConfig{Capacity: cfg.FilterCapacity, MaxKeys: maxKeys,
			MaxDeltaKeys: 150}, rng.Uint64()|1, base)
		s.replicas = append(s.replicas, &replica{
			name: name, member: member, eng: eng,
			set:    residentset.New(residentset.Options{}),
			gens:   gens,
			sender: filterstream.NewSender(filterstream.SenderConfig{Self: member, Name: name, Epoch: gens.Stats().Epoch}),
			load:   filterstream.Load{Healthy: true},
		})
		s.sidecarIdx[member], s.replicaIdx[name] = i, i
		engines, names = append(engines, eng), append(names, name)
	}
	if cfg.Policy == OracleName {
		s.oracle = newOracle(engines, names)
	}
	s.settings = plan.Settings{MaxPrefixTokens: tokenize.DefaultMaxPrefixTokens, MaxPrefixBytes: tokenize.DefaultMaxPrefixBytes, MaxAttempts: 3}
	routerMeta := filterstream.Meta{Role: filterstream.RoleRouter, SchemeVersion: blockkey.SchemeVersion, Capabilities: filterstream.CapInflightOthers}
	// The routers' mirrors of a snapshot they all received share its bits
	// (each still sees exactly the deltas it applied): sixteen copies of a
	// thousand 81 kB filters would be most of the run's memory.
	share := bloom.NewShare()
	for j := range cfg.Routers {
		name := fmt.Sprintf("router-%d", j)
		table := fleet.NewTable(fleet.TableConfig{})
		rt := &router{
			name: name, table: table,
			recv:     filterstream.NewReceiver(filterstream.ReceiverConfig{Self: name, Epoch: rng.Uint64() | 1, Share: share}, table),
			inflight: make([]inflight, cfg.Replicas),
		}
		switch cfg.Policy {
		case OracleName:
			rt.policy = s.oracle
		case GuessName:
			rt.policy = newRouterGuess(rt.inflight, s.replicaIdx)
		default:
			p, err := routing.New(cfg.Policy, cfg.Routing)
			if err != nil {
				return err
			}
			rt.policy = p
		}
		s.routers = append(s.routers, rt)
		s.routerIdx[name] = j
	}
	for _, rt := range s.routers {
		for _, other := range s.routers {
			if other != rt {
				m := routerMeta
				m.Name = other.name
				rt.recv.Member(other.name, m, base)
			}
		}
		for _, r := range s.replicas {
			rt.recv.Member(r.member, filterstream.Meta{
				Role: filterstream.RoleSidecar, Name: r.name, Models: []string{model}, EngineURL: "http://" + r.name,
				Protocol: fleet.ProtocolVLLM, BlockSize: cfg.Engine.BlockSize, SchemeVersion: blockkey.SchemeVersion,
				Capabilities: filterstream.CapKVEvents | filterstream.CapInflight | filterstream.CapInflightOthers,
				Epoch:        r.gens.Stats().Epoch,
			}, base)
		}
	}
	// Timers start at random phases: real processes do not tick in step.
	phase := func(every time.Duration) time.Duration { return time.Duration(rng.Int64N(int64(every))) }
	for i, r := range s.replicas {
		for _, rt := range s.routers {
			m := routerMeta
			m.Name = rt.name
			s.fromSidecar(i, r.sender.Member(rt.name, m, true))
		}
		s.q.at(phase(cfg.DeltaInterval), evSidecarFlush, i, nil)
		s.q.at(phase(cfg.LoadInterval), evSidecarLoad, i, nil)
		s.q.at(phase(cfg.ScrapeInterval), evSidecarScrape, i, nil)
		s.q.at(phase(time.Second), evSidecarRebuild, i, nil)
	}
	for j := range s.routers {
		s.q.at(phase(cfg.RouterTick), evRouterTick, j, nil)
	}
	return nil
}

func (s *sim) wall() time.Time { return base.Add(s.now) }

func (s *sim) handle(ev event) {
	cfg := &s.cfg
	switch ev.kind {
	case evArrival:
		s.arrive(ev.a)
	case evStepDone:
		s.stepDone(ev.a)
	case evSidecarFlush:
		r := s.replicas[ev.a]
		s.fromSidecar(ev.a, r.sender.Flush(r.gens))
		s.q.at(s.now+cfg.DeltaInterval, evSidecarFlush, ev.a, nil)
	case evSidecarLoad:
		r := s.replicas[ev.a]
		s.fromSidecar(ev.a, r.sender.Flush(r.gens))
		s.fromSidecar(ev.a, r.sender.Load(r.load, r.gens, false, s.wall()))
		s.q.at(s.now+cfg.LoadInterval, evSidecarLoad, ev.a, nil)
	case evSidecarScrape:
		s.replicas[ev.a].scrape()
		s.q.at(s.now+cfg.ScrapeInterval, evSidecarScrape, ev.a, nil)
	case evSidecarRebuild:
		s.replicas[ev.a].maybeRebuild(s.wall())
		s.q.at(s.now+time.Second, evSidecarRebuild, ev.a, nil)
	case evRouterTick:
		s.fromRouter(ev.a, s.routers[ev.a].recv.Tick(s.wall()))
		s.q.at(s.now+cfg.RouterTick, evRouterTick, ev.a, nil)
	case evToRouter:
		rt := s.routers[ev.a]
		out := rt.recv.Handle(ev.msg, s.wall())
		if out.Cleared {
			if c, ok := rt.policy.(routing.Clearer); ok {
				c.ClearRecords(out.ClearedNames)
			}
		}
		s.fromRouter(ev.a, out)
	case evToSidecar:
		r := s.replicas[ev.a]
		out := r.sender.Handle(ev.msg, s.wall())
		if out.Cleared {
			r.rebuild(s.wall())
		}
		s.fromSidecar(ev.a, out)
	}
	if ev.owned {
		s.freeMessage(ev.msg)
	}
}

// sendOrder returns the indexes of a state machine's sends by recipient,
// keeping each recipient's in order: the machines range over maps, and the
// network's draws must not depend on map order. (Indexes, not the sends
// themselves, are sorted: a send is a whole message.)
func (s *sim) sendOrder(sends []filterstream.Send) []int {
	s.order = s.order[:0]
	for i := range sends {
		s.order = append(s.order, i)
	}
	slices.SortStableFunc(s.order, func(a, b int) int { return cmp.Compare(sends[a].To, sends[b].To) })
	return s.order
}

// fromSidecar carries out what replica i's Sender asked.
func (s *sim) fromSidecar(i int, out filterstream.Output) {
	for _, si := range s.sendOrder(out.Sends) {
		snd := &out.Sends[si]
		if j, ok := s.routerIdx[snd.To]; ok {
			s.deliver(link{i, s.cfg.Replicas + j}, snd.Reliable, evToRouter, j, snd.Msg)
		}
	}
	if len(out.Snapshots) == 0 {
		return
	}
	slices.Sort(out.Snapshots)
	snap := s.replicas[i].snapshot()
	for _, name := range slices.Compact(out.Snapshots) {
		if j, ok := s.routerIdx[name]; ok {
			s.deliverShared(link{i, s.cfg.Replicas + j}, true, evToRouter, j, snap)
		}
	}
}

// fromRouter carries out what router j's Receiver asked.
func (s *sim) fromRouter(j int, out filterstream.Output) {
	for _, si := range s.sendOrder(out.Sends) {
		snd := &out.Sends[si]
		from := s.cfg.Replicas + j
		if i, ok := s.sidecarIdx[snd.To]; ok {
			s.deliver(link{from, i}, snd.Reliable, evToSidecar, i, snd.Msg)
		} else if k, ok := s.routerIdx[snd.To]; ok {
			s.deliver(link{from, s.cfg.Replicas + k}, snd.Reliable, evToRouter, k, snd.Msg)
		}
	}
}

// deliver sends msg over l in a message of the simulator's own, which
// goes back to its free list once handled (neither state machine keeps a
// message it handled).
func (s *sim) deliver(l link, stream bool, k kind, to int, msg filterstream.Message) {
	var m *filterstream.Message
	if n := len(s.freeMsgs); n > 0 {
		m, s.freeMsgs = s.freeMsgs[n-1], s.freeMsgs[:n-1]
	} else {
		m = new(filterstream.Message)
	}
	*m = msg
	if !s.send(l, stream, k, to, m, true) {
		s.freeMessage(m)
	}
}

func (s *sim) freeMessage(m *filterstream.Message) {
	*m = filterstream.Message{}
	s.freeMsgs = append(s.freeMsgs, m)
}

// deliverShared sends msg, which recipients only read, over l.
func (s *sim) deliverShared(l link, stream bool, k kind, to int, msg *filterstream.Message) {
	s.send(l, stream, k, to, msg, false)
}

// send queues msg's arrival over l unless the network loses it, and
// reports whether it was queued.
func (s *sim) send(l link, stream bool, k kind, to int, msg *filterstream.Message, owned bool) bool {
	at, ok := s.net.arrival(s.now, l, stream)
	if !ok {
		return false
	}
	s.q.put(at, k, to, msg, owned)
	if k == evToRouter && to == 0 {
		s.countGossip(msg)
	}
	return true
}

// arrive routes request k at its router and hands it to the engine
// picked; the router-to-engine hop takes no simulated time.
func (s *sim) arrive(k int) {
	wr := &s.w.Requests[k]
	st := &s.reqs[k]
	st.start = s.now - s.cfg.Warmup
	st.router = k % len(s.routers)
	rt := s.routers[st.router]
	ids, err := s.prompts.get(k)
	if err != nil {
		s.fail(k, err.Error())
		return
	}
	if s.oracle != nil {
		s.oracle.hashes = blockkey.Append(s.oracle.hashes[:0], s.replicas[0].eng.Config().HashSeed, ids, s.cfg.Engine.BlockSize)
	}
	snap := rt.table.Snapshot()
	// Nothing holds the snapshot past this decision: its memory can carry
	// a later one.
	defer rt.table.Recycle(snap)
	req := request.Request{Kind: request.Completion, Model: model, PromptIDs: ids}
	set := s.settings
	set.Policy = rt.policy
	in := plan.Input{Snapshot: snap, Loads: rt.planLoads(snap, s.replicaIdx), Request: &req, Model: model, Settings: set, Now: s.wall()}
	if err := rt.plan.Decide(&in); err != nil {
		s.fail(k, err.Error())
		return
	}
	t := &rt.plan.Targets[0]
	i, ok := s.replicaIdx[t.Name]
	if !ok {
		s.fail(k, "fleetsim: target "+t.Name+" is no replica")
		return
	}
	if t.PrefixAware && !rt.plan.Decision.Degraded {
		if rec, ok := rt.policy.(routing.Recorder); ok {
			rec.Record(&rt.plan.Request, t.Name, t.FilterMatched, s.wall())
		}
	}
	r := s.replicas[i]
	err = r.eng.Add(engine.Request{ID: uint64(k), Prompt: ids, MaxTokens: wr.MaxTokens, OutputSeed: s.cfg.Seed + uint64(k)})
	if s.oracle != nil {
		s.oracle.changed(i)
	}
	if err != nil {
		s.fail(k, err.Error())
		return
	}
	st.replica, st.mode, st.predicted, st.uncached = i, t.Mode, t.PredictedCached, t.Uncached
	rt.account(i, r.name, 1, t.Uncached)
	if s.oracle != nil {
		st.hashes = slices.Clone(s.oracle.hashes)
		s.oracle.sent(i, st.hashes)
	}
	if !r.busy {
		s.step(i)
	}
}

func (s *sim) fail(k int, msg string) {
	s.reqs[k].err = msg
	s.reqs[k].replica = -1
	s.done++
}

// step starts replica i's next engine step; it ends after the duration
// the engine returned.
func (s *sim) step(i int) {
	r := s.replicas[i]
	res := r.eng.Step(s.now.Seconds())
	if s.oracle != nil {
		s.oracle.changed(i)
	}
	r.outputs = append(r.outputs[:0], res.Outputs...)
	r.events = r.events[:0]
	if res.Events != nil {
		r.events = append(r.events, res.Events.Events...)
	}
	if res.Scheduled == 0 && res.Duration == 0 {
		r.busy = false
		r.apply(r.events, s.wall())
		return
	}
	r.busy = true
	s.q.at(s.now+res.Duration, evStepDone, i, nil)
	if s.oracle != nil {
		s.oracle.stepEnds[i] = s.wall().Add(res.Duration)
	}
}

// stepDone publishes the step's KV events to the sidecar, delivers its
// tokens and starts the next step if there is work.
func (s *sim) stepDone(i int) {
	r := s.replicas[i]
	if len(r.events) > 0 {
		r.apply(r.events, s.wall())
	}
	for _, o := range r.outputs {
		st := &s.reqs[o.ID]
		rt := s.routers[st.router]
		if o.First {
			st.ttft = s.now - s.cfg.Warmup - st.start
			st.cached = o.CachedTokens
			rt.account(i, r.name, 0, -st.uncached)
			if s.oracle != nil {
				s.oracle.done(i, st.hashes)
				st.hashes = nil
			}
		}
		if o.Finished != engine.NotFinished {
			st.e2e = s.now - s.cfg.Warmup - st.start
			st.output = o.Generated
			rt.account(i, r.name, -1, 0)
			s.done++
			if s.cfg.Progress != nil && s.done%4096 == 0 {
				s.cfg.Progress(Progress{Done: s.done, Total: len(s.reqs), Sim: s.now})
			}
		}
	}
	if r.eng.HasWork() {
		s.step(i)
	} else {
		r.busy = false
	}
}

// records turns the requests' states into load-test records.
func (s *sim) records() []report.Record {
	out := make([]report.Record, len(s.reqs))
	for k := range s.reqs {
		st, wr := &s.reqs[k], &s.w.Requests[k]
		rec := report.Record{
			Policy: s.cfg.Policy, Router: s.routers[k%len(s.routers)].name, Key: wr.Key,
			Start: st.start, PredictedCached: -1, PromptTokens: wr.PromptTokens,
			Tenant: wr.Tenant, Priority: wr.Priority, QueueMs: -1,
		}
		switch {
		case st.err != "":
			rec.Err = st.err
		case st.e2e == 0:
			rec.Err = "unfinished when the drain ended"
		default:
			rec.Status = 200
			rec.Replica, rec.Mode = s.replicas[st.replica].name, string(st.mode)
			rec.TTFT, rec.E2E = st.ttft, st.e2e
			rec.PredictedCached, rec.ActualCached, rec.OutputTokens = st.predicted, st.cached, st.output
		}
		out[k] = rec
	}
	return out
}
