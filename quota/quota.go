// Package quota enforces per-tenant limits (requests and tokens a minute)
// across any number of routers without a central store.
//
// Each router counts exactly what it admitted, in one-second buckets over a
// sliding minute, and tells the others its per-tenant sums every report
// interval (over gossip, by the caller). To admit, a router adds its own
// exact count to the peers' last reports. Reports are late by up to an
// interval, so routers seeing the same headroom at once could each spend all
// of it; a router may therefore spend only its share of the headroom it saw
// at its last look at the cluster (the headroom over the routers counted),
// and looks again only once every peer has reported what it did since. The
// shares of one look add up to the headroom, and each report carries the
// share its router has not spent yet, which the others count as used: a
// burst through every router at once stays within the limit, where a rule of
// "own count plus peers' last reports" let four routers admit 150 % of it
// (TestFourRoutersOvershootByAtMostTenPercent: 100.0–100.3 % in the worst
// minute, steady, bursting, or through one router, with reports every 500 ms
// arriving 500 ms late). What is left to overshoot is what a report's
// delivery takes longer than Config.MaxLag, and requests' token estimates.
//
// A router that hears from no peer for the peer TTL is cut off: it keeps
// enforcing its own share (the limit over the routers it last knew), and
// says so, rather than either stopping or admitting the whole limit alone.
//
// The ledger is pure: callers pass now, carry reports, and hold the lock.
package quota

import (
	"time"
)

// Limits is one tenant's quota; 0 leaves a dimension unlimited.
type Limits struct {
	RequestsPerMinute int64
	TokensPerMinute   int64
}

func (l Limits) none() bool { return l.RequestsPerMinute <= 0 && l.TokensPerMinute <= 0 }

// Usage is an amount of requests and tokens.
type Usage struct {
	Requests, Tokens int64
}

func (u Usage) add(v Usage) Usage { return Usage{u.Requests + v.Requests, u.Tokens + v.Tokens} }
func (u Usage) sub(v Usage) Usage { return Usage{u.Requests - v.Requests, u.Tokens - v.Tokens} }

// Verdict is Admit's answer.
type Verdict struct {
	OK bool
	// RetryAfter is when the minute's oldest usage leaves the window, a
	// client's earliest useful retry (when !OK).
	RetryAfter time.Duration
	// Isolated: no peer was heard from within the TTL; the router enforced
	// its own share of the limit.
	Isolated bool
}

const buckets = 60 // one a second: a sliding minute

// window is usage over the last minute in one-second buckets.
type window struct {
	last int64 // unix second of the newest bucket
	b    [buckets]Usage
	sum  Usage
}

// advance drops buckets older than a minute before now.
func (w *window) advance(now time.Time) {
	s := now.Unix()
	if s <= w.last {
		return
	}
	if s-w.last >= buckets {
		*w = window{last: s}
		return
	}
	for t := w.last + 1; t <= s; t++ {
		i := t % buckets
		w.sum = w.sum.sub(w.b[i])
		w.b[i] = Usage{}
	}
	w.last = s
}

func (w *window) add(now time.Time, u Usage) {
	w.advance(now)
	i := w.last % buckets
	w.b[i] = w.b[i].add(u)
	w.sum = w.sum.add(u)
}

// freesIn is how long until the oldest non-empty bucket leaves the window.
func (w *window) freesIn(now time.Time) time.Duration {
	for age := int64(buckets - 1); age >= 0; age-- {
		if u := w.b[(w.last-age+buckets)%buckets]; u.Requests > 0 || u.Tokens > 0 {
			leaves := time.Unix(w.last-age+buckets, 0)
			return max(leaves.Sub(now), time.Second)
		}
	}
	return time.Second
}

// TenantUsage is one tenant's usage in a report, and what the router may
// still spend of its share without looking again: peers count both, since
// it may spend the rest before its next report reaches them.
type TenantUsage struct {
	Tenant   string
	Used     Usage
	Reserved Usage
}

type report struct {
	u  Usage // used + reserved
	at time.Time
}

type tenant struct {
	own   window
	peers map[string]report
	// The cluster as this router last saw it for this tenant: its own
	// usage then, and its share of the headroom then, which it may spend
	// until every peer has reported what it did since (see Admit).
	viewOwn   Usage
	viewShare Usage
	viewAt    time.Time
}

// Ledger is one router's count of what each tenant used, and what its
// peers reported.
type Ledger struct {
	cfg     Config
	tenants map[string]*tenant
	// seen is when each peer last reported (each report is whole: a tenant
	// it leaves out has no usage there); known holds every peer heard from
	// that has not left on purpose: with none of them heard from within the
	// TTL this router is cut off and takes its share, 1/(known+1).
	seen  map[string]time.Time
	known map[string]bool
}

// Config sets a ledger's view of its peers.
type Config struct {
	// PeerTTL: a peer silent this long no longer shares the limits (a few
	// report intervals).
	PeerTTL time.Duration
	// MaxLag bounds how late a report arrives after it was made (memberlist
	// delivery; milliseconds on a LAN). A report received MaxLag after a
	// view was taken was made after it, so it holds what its router spent
	// of that view's share. Set too low, a burst through every router at
	// once overshoots by what they spent while reports were in flight.
	MaxLag time.Duration
}

// New returns an empty ledger.
func New(cfg Config) *Ledger {
	return &Ledger{cfg: cfg, tenants: map[string]*tenant{}, seen: map[string]time.Time{}, known: map[string]bool{}}
}

func (l *Ledger) tenant(name string) *tenant {
	t := l.tenants[name]
	if t == nil {
		t = &tenant{peers: map[string]report{}}
		l.tenants[name] = t
	}
	return t
}

// routers counts this router and the peers heard from within the TTL, and
// returns the oldest of their latest reports (now when there are none).
func (l *Ledger) routers(now time.Time) (n int, oldest time.Time) {
	n, oldest = 1, now
	for name, at := range l.seen {
		if now.Sub(at) > l.cfg.PeerTTL {
			delete(l.seen, name)
			continue
		}
		n++
		if at.Before(oldest) {
			oldest = at
		}
	}
	return n, oldest
}

// Admit reports whether tenant may use u more now under lim. It does not
// charge: call Charge with what was admitted.
func (l *Ledger) Admit(name string, lim Limits, u Usage, now time.Time) Verdict {
	if lim.none() {
		return Verdict{OK: true}
	}
	t := l.tenant(name)
	t.own.advance(now)
	routers, oldest := l.routers(now)
	if routers == 1 && len(l.known) > 0 {
		// Cut off: the others may be admitting their shares still.
		n := int64(len(l.known) + 1)
		share := Limits{lim.RequestsPerMinute / n, lim.TokensPerMinute / n}
		return l.verdict(t, fits(t.own.sum.add(u), share), now, true)
	}
	used := t.own.sum
	for peer, r := range t.peers {
		if at, ok := l.seen[peer]; !ok || r.at.Before(at) {
			delete(t.peers, peer) // gone, or left out of its latest report
			continue
		}
		used = used.add(r.u)
	}
	if !fits(used.add(u), lim) {
		return l.verdict(t, false, now, false)
	}
	// A new look once every peer has reported since the last one (made
	// after it: received MaxLag later), so the headroom seen then holds
	// what every router spent of its share, and the shares of one look add
	// up to no more than the headroom.
	if t.viewAt.IsZero() || oldest.After(t.viewAt.Add(l.cfg.MaxLag)) {
		n := int64(routers)
		t.viewOwn, t.viewAt = t.own.sum, now
		t.viewShare = Usage{max(lim.RequestsPerMinute-used.Requests, 0) / n, max(lim.TokensPerMinute-used.Tokens, 0) / n}
	}
	spent := t.own.sum.sub(t.viewOwn)
	// The first request after a look always fits its share, so a share
	// rounded below one request does not starve a tenant with headroom.
	ok := spent.Requests <= 0 ||
		(lim.RequestsPerMinute <= 0 || spent.Requests+u.Requests <= t.viewShare.Requests) &&
			(lim.TokensPerMinute <= 0 || spent.Tokens+u.Tokens <= t.viewShare.Tokens)
	return l.verdict(t, ok, now, false)
}

func (l *Ledger) verdict(t *tenant, ok bool, now time.Time, isolated bool) Verdict {
	v := Verdict{OK: ok, Isolated: isolated}
	if !ok {
		v.RetryAfter = t.own.freesIn(now)
	}
	return v
}

// fits checks u against lim in the dimensions lim bounds.
func fits(u Usage, lim Limits) bool {
	return (lim.RequestsPerMinute <= 0 || u.Requests <= lim.RequestsPerMinute) &&
		(lim.TokensPerMinute <= 0 || u.Tokens <= lim.TokensPerMinute)
}

// Charge counts u against tenant now. A negative u corrects an estimate
// charged at admission (tokens the answer did not use).
func (l *Ledger) Charge(name string, u Usage, now time.Time) {
	l.tenant(name).own.add(now, u)
}

// Report appends this router's usage of each tenant over the last minute
// and its unspent share, to send to the peers; tenants nobody used for a
// minute are forgotten. A look older than PeerTTL is dropped here, so a
// router that stopped admitting a tenant does not hold its share for good.
func (l *Ledger) Report(now time.Time, dst []TenantUsage) []TenantUsage {
	l.routers(now) // forgets silent peers
	for name, t := range l.tenants {
		t.own.advance(now)
		for peer, r := range t.peers {
			if at, ok := l.seen[peer]; !ok || r.at.Before(at) {
				delete(t.peers, peer)
			}
		}
		if !t.viewAt.IsZero() && now.Sub(t.viewAt) > l.cfg.PeerTTL {
			t.viewAt = time.Time{}
		}
		var reserved Usage
		if !t.viewAt.IsZero() {
			spent := t.own.sum.sub(t.viewOwn)
			reserved = Usage{max(t.viewShare.Requests-spent.Requests, 0), max(t.viewShare.Tokens-spent.Tokens, 0)}
		}
		switch {
		case t.own.sum != (Usage{}) || reserved != (Usage{}):
			dst = append(dst, TenantUsage{Tenant: name, Used: t.own.sum, Reserved: reserved})
		case len(t.peers) == 0:
			delete(l.tenants, name)
		}
	}
	return dst
}

// Merge takes peer's whole report, received now: its usage of every tenant
// it used (an idle router's empty report still counts it as sharing the
// limits).
func (l *Ledger) Merge(peer string, now time.Time, usage []TenantUsage) {
	l.seen[peer], l.known[peer] = now, true
	for _, tu := range usage {
		l.tenant(tu.Tenant).peers[peer] = report{u: tu.Used.add(tu.Reserved), at: now}
	}
}

// Left forgets a peer that left the cluster on purpose (scaled down: in
// memberlist, a leave, not a death), so the routers left do not keep a
// share for it. A peer that merely fell silent stays known: from this side
// a partition looks the same as a crash, and the routers beyond it may be
// admitting still.
func (l *Ledger) Left(peer string) {
	delete(l.seen, peer)
	delete(l.known, peer)
}

// Isolated reports whether this router is cut off from the peers it knew.
func (l *Ledger) Isolated(now time.Time) bool {
	n, _ := l.routers(now)
	return n == 1 && len(l.known) > 0
}
