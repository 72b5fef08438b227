package gateway

import (
	"net"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/hangup"
	"github.com/kvmesh/kvmesh/proxy"
)

// clientWatch notices clients that hang up while an engine works on their
// request, and aborts the request so the engine stops: fasthttp tells a
// handler nothing of its client until it writes, and a stream writes
// nothing while the engine queues and prefills. One
// goroutine, running only while requests are watched, polls each
// client's socket a few times a second once the request is older than
// watchAfter.
type clientWatch struct {
	mu      sync.Mutex
	m       map[*proxy.Abort]watchedClient
	running bool
}

type watchedClient struct {
	conn  net.Conn
	since time.Time
}

const (
	watchAfter = 500 * time.Millisecond
	watchEvery = 250 * time.Millisecond
)

// add watches conn for a as long as the request runs (until remove).
func (w *clientWatch) add(a *proxy.Abort, conn net.Conn) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.m == nil {
		w.m = map[*proxy.Abort]watchedClient{}
	}
	w.m[a] = watchedClient{conn, time.Now()}
	if !w.running {
		w.running = true
		go w.loop()
	}
}

// remove stops watching a; once it returns the watcher no longer touches
// the connection (checks run under the same lock).
func (w *clientWatch) remove(a *proxy.Abort) {
	w.mu.Lock()
	delete(w.m, a)
	w.mu.Unlock()
}

func (w *clientWatch) loop() {
	t := time.NewTicker(watchEvery)
	defer t.Stop()
	for range t.C {
		w.mu.Lock()
		if len(w.m) == 0 {
			w.running = false
			w.mu.Unlock()
			return
		}
		now := time.Now()
		for a, c := range w.m {
			if now.Sub(c.since) >= watchAfter && hangup.Gone(c.conn) {
				a.Now()
				delete(w.m, a)
			}
		}
		w.mu.Unlock()
	}
}
