package memberflags

import (
	"flag"
	"io"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/gossip"
)

func parse(t *testing.T, gossipBind string, args ...string) *Flags {
	t.Helper()
	var f Flags
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f.Register(fs, gossipBind)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return &f
}

func TestGossipConfigFromFlags(t *testing.T) {
	f := parse(t, "0.0.0.0:7946", "--join", " a:1, ,b:2 ,", "--gossip-key", "MDEyMzQ1Njc4OWFiY2RlZg==",
		"--gossip-label", "prod", "--gossip-advertise", "10.0.0.1:7946", "--gossip-trust-sender")
	c, err := f.Gossip()
	if err != nil {
		t.Fatal(err)
	}
	if c.BindAddr != "0.0.0.0:7946" || c.AdvertiseAddr != "10.0.0.1:7946" || !slices.Equal(c.Join, []string{"a:1", "b:2"}) ||
		string(c.Key) != "0123456789abcdef" || c.Label != "prod" || !c.TrustClaimedSender {
		t.Fatalf("gossip config %+v", c)
	}
}

func TestDefaults(t *testing.T) {
	f := parse(t, "")
	c, err := f.Gossip()
	if err != nil {
		t.Fatal(err)
	}
	if c.BindAddr != "" || c.Join != nil || c.Key != nil || c.Label != gossip.DefaultLabel || c.TrustClaimedSender ||
		f.EngineAPIKey != "" || f.Log.Format != "console" || f.Log.Level != "info" {
		t.Fatalf("defaults: %+v, %+v", f, c)
	}
}

func TestBadKeyIsRefused(t *testing.T) {
	_, err := parse(t, "", "--gossip-key", "bm9wZQ==").Gossip()
	if err == nil || !strings.Contains(err.Error(), "4 bytes") {
		t.Fatalf("a 4-byte key: %v", err)
	}
}
