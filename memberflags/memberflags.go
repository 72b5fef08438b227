// Package memberflags registers the flags the router and the sidecar take
// alike: how a member joins the gossip cluster, the engines' API key and
// logging. One registration keeps their names, defaults and help the same
// in both binaries, so an operator's settings for one cluster fit both.
package memberflags

import (
	"flag"
	"strings"

	"github.com/kvmesh/kvmesh/gossip"
	"github.com/kvmesh/kvmesh/logging"
)

// Flags are the shared flags' values.
type Flags struct {
	GossipBind, GossipAdvertise string
	Join                        string // comma list
	GossipKey                   string // base64
	GossipLabel                 string
	GossipTrustSender           bool
	EngineAPIKey                string
	Log                         logging.Options
}

// Register adds the shared flags to fs. gossipBind is --gossip-bind's
// default, the one that differs by role: a sidecar always gossips, a router
// only when given an address or --join.
func (f *Flags) Register(fs *flag.FlagSet, gossipBind string) {
	fs.StringVar(&f.GossipBind, "gossip-bind", gossipBind, "gossip listen host:port (UDP and TCP); a router given neither this nor --join runs without gossip, on static upstreams only")
	fs.StringVar(&f.GossipAdvertise, "gossip-advertise", "", "gossip host:port others reach this member at")
	fs.StringVar(&f.Join, "join", "", "comma list of gossip host:port to join")
	fs.StringVar(&f.GossipKey, "gossip-key", "", "base64 AES key (16, 24 or 32 bytes) encrypting gossip")
	fs.StringVar(&f.GossipLabel, "gossip-label", gossip.DefaultLabel, "cluster label, the same on every sidecar and router of one cluster; members with another label are rejected")
	fs.BoolVar(&f.GossipTrustSender, "gossip-trust-sender", false, "take a gossip message's named sender on trust instead of checking it against the address it came from: only where members do not send from the address they advertise (NAT)")
	fs.StringVar(&f.EngineAPIKey, "engine-api-key", "", "API key the engines were started with (vllm serve --api-key): the sidecar sends it to its engine, the router to every replica instead of the client's Authorization; prefer the env variable")
	f.Log.Register(fs)
}

// Gossip is the gossip configuration the flags give; the caller names the
// member and gives it a logger.
func (f *Flags) Gossip() (gossip.Config, error) {
	key, err := gossip.ParseKey(f.GossipKey)
	if err != nil {
		return gossip.Config{}, err
	}
	c := gossip.Config{BindAddr: f.GossipBind, AdvertiseAddr: f.GossipAdvertise, Key: key,
		Label: f.GossipLabel, TrustClaimedSender: f.GossipTrustSender}
	for _, j := range strings.Split(f.Join, ",") {
		if j = strings.TrimSpace(j); j != "" {
			c.Join = append(c.Join, j)
		}
	}
	return c, nil
}
