package filterstream

import (
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/fleet"
)

// The previous release's side of a version skew is its wire bytes: its
// messages encode as testdata/wire's goldens (TestWireGoldens holds this
// build to the same bytes) and its metadata as the *-before-* goldens,
// which lack the fields appended since. These tests run this build's
// Receiver and Sender against those bytes.

// goldenMeta decodes testdata/wire/name.hex.
func goldenMeta(t *testing.T, name string) Meta {
	t.Helper()
	m, err := DecodeMeta(readGolden(t, name))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return m
}

// goldenMessage decodes testdata/wire/name.hex.
func goldenMessage(t *testing.T, name string) Message {
	t.Helper()
	m, err := Decode(readGolden(t, name))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return m
}

// earlierSidecars are the sidecar metadata goldens of earlier layouts and
// what the router must make of each: the fields they lack take the
// defaults (not data-parallel, no offload tier, KV role both).
var earlierSidecars = []struct {
	file     string
	name     string
	dp       bool
	rank     int
	media    []string
	wantRole fleet.KVRole
}{
	{"meta-sidecar-before-dp", "a", false, 0, nil, fleet.KVBoth},
	{"meta-sidecar-before-tiers", "a", false, 0, nil, fleet.KVBoth},
	{"meta-sidecar-before-role", "a", false, 0, nil, fleet.KVBoth},
	{"meta-sidecar-dp-before-tiers", "a-dp3", true, 3, nil, fleet.KVBoth},
	{"meta-sidecar-dp-before-role", "a-dp3", true, 3, nil, fleet.KVBoth},
	{"meta-sidecar-tiers-before-role", "b", false, 0, []string{"CPU", "DISK"}, fleet.KVBoth},
}

var earlierRouters = []string{"meta-router-before-dp", "meta-router-before-tiers", "meta-router-before-role"}

// TestVersionSkewWithEarlierLayouts runs a stream between members that
// announced themselves in the earlier metadata layouts (each sidecar
// golden against each router golden) and one router of this build beside
// them: both routers route by the sidecar's filter and load with the
// defaults for what the earlier metadata lacks, a route clear from the
// earlier router rebuilds the filter and reaches the other router, and its
// in-flight reports reach the sidecar and, through its load records, the
// other router.
func TestVersionSkewWithEarlierLayouts(t *testing.T) {
	for _, sc := range earlierSidecars {
		for _, rf := range earlierRouters {
			t.Run(sc.file+"/"+rf, func(t *testing.T) {
				c := newCluster(t)
				old := c.addRouterAs(goldenMeta(t, rf))
				cur := c.addRouter("r2")
				s := c.addSidecarAs(goldenMeta(t, sc.file))
				if s.meta.Name != sc.name {
					t.Fatalf("%s names %q, want %q", sc.file, s.meta.Name, sc.name)
				}
				s.add(seq(100, 40)...)
				c.settle()
				for _, r := range []*simRouter{old, cur} {
					c.holds(r, s)
					rep, _ := replica(r.tb, sc.name)
					if rep.KVRole != sc.wantRole || rep.DataParallel != sc.dp || rep.DataParallelRank != sc.rank ||
						!slices.Equal(rep.OffloadMedia, sc.media) || rep.BlockSize != 16 || !slices.Equal(rep.Models, s.meta.Models) {
						t.Fatalf("%s: replica %s: role %v, data-parallel %v rank %d, media %v, block size %d, models %v; want %v, %v %d, %v, 16, %v",
							r.member, sc.name, rep.KVRole, rep.DataParallel, rep.DataParallelRank, rep.OffloadMedia, rep.BlockSize, rep.Models,
							sc.wantRole, sc.dp, sc.rank, sc.media, s.meta.Models)
					}
				}

				// A clear from the earlier router: the sidecar rebuilds,
				// the other router drops its copy, both hold the rebuilt
				// generation.
				gen := s.g.Stats().Generation
				c.take(old.member, old.r.ClearRoutes([]string{sc.name}, 1, c.now))
				c.deliver()
				if cur.clears != 1 {
					t.Fatalf("the router of this build heard %d clears, want 1", cur.clears)
				}
				c.settle()
				if s.g.Stats().Generation <= gen {
					t.Fatalf("sidecar still at generation %d after the clear", gen)
				}
				c.holds(old, s)
				c.holds(cur, s)

				old.r.SetInflight(sc.name, 2, 300)
				c.rounds(8)
				if req, tok := s.s.Inflight(c.now); req != 2 || tok != 300 {
					t.Fatalf("sidecar sums %d requests, %d tokens in flight, want the earlier router's 2, 300", req, tok)
				}
				if rep, _ := replica(cur.tb, sc.name); rep.Load.OthersInflightRequests != 2 || rep.Load.OthersInflightPrefillTokens != 300 {
					t.Fatalf("the router of this build sees %+v, want the earlier router's 2 requests, 300 tokens", rep.Load)
				}
				if rep, _ := replica(old.tb, sc.name); rep.Load.OthersInflightRequests != 0 {
					t.Fatalf("the earlier router is sent its own in-flight work back: %+v", rep.Load)
				}
			})
		}
	}
}

// TestEarlierBuildsMessageBytesDriveThisBuild feeds the golden message
// bytes themselves: a sidecar known by its earliest metadata layout, its
// snapshot, delta and load record make this build's router route by that
// filter and load; a router known by its earliest metadata, its resync,
// in-flight report and route clear are answered by this build's sidecar.
func TestEarlierBuildsMessageBytesDriveThisBuild(t *testing.T) {
	now := time.Unix(1_900_000_000, 0)
	tb := fleet.NewTable(fleet.TableConfig{})
	r := NewReceiver(ReceiverConfig{Self: "router/r2", Epoch: 5}, tb)
	r.Member("sidecar/a", goldenMeta(t, "meta-sidecar-before-dp"), now)
	for _, name := range []string{"snapshot", "delta", "load"} {
		m := goldenMessage(t, name)
		if out := r.Handle(&m, now); out.Bad != 0 || out.Resyncs != 0 {
			t.Fatalf("%s: %+v", name, out)
		}
	}
	rep, ok := replica(tb, "a")
	if !ok || !rep.Online || !rep.KVEvents || rep.URL != "http://127.0.0.1:8000" || !slices.Equal(rep.Models, []string{"llama", "lora-a"}) {
		t.Fatalf("replica a: %+v", rep)
	}
	want := fleet.Load{Waiting: 2, Running: 5, KVUsage: 0.5, OthersInflightRequests: 4, OthersInflightPrefillTokens: 900}
	if rep.Load != want || rep.KVRole != fleet.KVBoth || rep.DataParallel || rep.OffloadMedia != nil {
		t.Fatalf("replica a: load %+v, role %v, data-parallel %v, media %v; want %+v, both, none, none",
			rep.Load, rep.KVRole, rep.DataParallel, rep.OffloadMedia, want)
	}
	for _, k := range []uint64{11, 12, 13, 1 << 40} { // the snapshot's keys, then the delta's
		if !hasKey(tb, "a", k) {
			t.Errorf("the router does not route key %d to a", k)
		}
	}

	s := NewSender(SenderConfig{Self: "sidecar/a", Name: "a", Epoch: 7})
	if out := s.Member("router/r1", goldenMeta(t, "meta-router-before-dp"), true); !slices.Equal(out.Snapshots, []string{"router/r1"}) {
		t.Fatalf("joining router: snapshots for %v", out.Snapshots)
	}
	m := goldenMessage(t, "resync-snapshot")
	if out := s.Handle(&m, now); out.Resyncs != 1 || !slices.Equal(out.Snapshots, []string{"router/r1"}) {
		t.Fatalf("resync: %+v", out)
	}
	m = goldenMessage(t, "inflight")
	if out := s.Handle(&m, now); !out.InflightChanged {
		t.Fatalf("in-flight report: %+v", out)
	}
	if req, tok := s.Inflight(now); req != 3 || tok != 4096 {
		t.Fatalf("in flight %d, %d; want the report's 3, 4096", req, tok)
	}
	// The earlier router announced CapInflightOthers: its own share is
	// left out of the load records it is sent.
	out := s.Load(Load{Healthy: true, Waiting: 1}, nil, false, now)
	if len(out.Sends) != 1 || out.Sends[0].To != "router/r1" || out.Sends[0].Msg.Load.InflightRequests != 0 {
		t.Fatalf("load record: %+v", out.Sends)
	}
	m = goldenMessage(t, "clear-routes-some")
	if out := s.Handle(&m, now); !out.Cleared {
		t.Fatalf("a clear naming a and b: %+v, want a cleared", out)
	}
}
