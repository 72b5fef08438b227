package gateway

import (
	"errors"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/tokenize"
)

// EngineTokenizer returns a tokenizer that asks a live replica serving model
// for its /tokenize answer (the `engine` tokenizer spec): exact for any
// model, at a round trip per uncached prompt. It prefers the first online
// replica in name order so that answers cache in one place; a replica that
// gives no answer (down, or a 5xx) is passed over for the next, and skipped
// for a while after, as the router ejects replicas it cannot reach. apiKey,
// when set, is sent as a bearer token (engines started with an API key).
func EngineTokenizer(table *fleet.Table, model, apiKey string) tokenize.Model {
	return &engineTokenizer{table: table, model: model, apiKey: apiKey, byURL: map[string]*tokenizingEngine{}}
}

type engineTokenizer struct {
	table   *fleet.Table
	model   string
	apiKey  string
	timeout time.Duration // per call; 0: the tokenize package's default

	mu     sync.Mutex
	byURL  map[string]*tokenizingEngine
	pruned time.Time // when byURL last lost the replicas gone from the table
}

type tokenizingEngine struct {
	*tokenize.Engine
	eject ejection
}

// maxEngineTries bounds the replicas one prompt is sent to.
const maxEngineTries = 3

var errNoEngine = errors.New("no live replica to tokenize with")

// engines fills picked with up to maxEngineTries replicas to ask, in name
// order, those not ejected first, and returns how many. (An array, not a
// slice: a prompt the engine answered before is served from its cache, and
// choosing where to ask should not allocate then.)
func (e *engineTokenizer) engines(now time.Time, picked *[maxEngineTries]*tokenizingEngine) int {
	snap := e.table.Snapshot()
	e.mu.Lock()
	defer e.mu.Unlock()
	if now.Sub(e.pruned) >= time.Minute {
		// Each engine keeps an answer cache (up to 16M ids): one whose
		// replica left the table (a pod replaced in a rollout) is dropped.
		e.pruned = now
		present := make(map[string]bool, len(snap.Replicas))
		for i := range snap.Replicas {
			present[snap.Replicas[i].URL] = true
		}
		for url := range e.byURL {
			if !present[url] {
				delete(e.byURL, url)
			}
		}
	}
	var ejected [maxEngineTries]*tokenizingEngine
	n, nOut := 0, 0
	for i := range snap.Replicas {
		r := &snap.Replicas[i]
		if !r.Online || !r.Serves(e.model) || r.URL == "" {
			continue
		}
		eng := e.byURL[r.URL]
		if eng == nil {
			opts := []tokenize.EngineOption{tokenize.WithEngineAPIKey(e.apiKey)}
			if e.timeout > 0 {
				opts = append(opts, tokenize.WithEngineTimeout(e.timeout))
			}
			eng = &tokenizingEngine{Engine: tokenize.NewEngine(r.URL, e.model, opts...)}
			e.byURL[r.URL] = eng
		}
		switch {
		case !eng.eject.out(now.UnixNano()):
			picked[n] = eng
			if n++; n == maxEngineTries {
				return n
			}
		case nOut < maxEngineTries:
			ejected[nOut] = eng
			nOut++
		}
	}
	return n + copy(picked[n:], ejected[:nOut])
}

// ask calls f with each replica to ask until one answers (or refuses the
// prompt itself: a 4xx would be the same everywhere).
func (e *engineTokenizer) ask(f func(*tokenize.Engine) error) error {
	now := time.Now()
	var picked [maxEngineTries]*tokenizingEngine
	n := e.engines(now, &picked)
	if n == 0 {
		return errNoEngine
	}
	engs := picked[:n]
	var err error
	for _, eng := range engs {
		err = f(eng.Engine)
		var ee *tokenize.EngineError
		if !errors.As(err, &ee) || ee.Status != 0 && ee.Status < 500 {
			eng.eject.reached()
			return err
		}
		// Ejected from the moment it failed: a call that timed out took
		// seconds, and an ejection counted from before it would be over.
		eng.eject.failed(time.Now())
	}
	return err
}

func (e *engineTokenizer) Encode(text string, addSpecialTokens bool) (ids []uint32, err error) {
	err = e.ask(func(eng *tokenize.Engine) error {
		ids, err = eng.Encode(text, addSpecialTokens)
		return err
	})
	return ids, err
}

func (e *engineTokenizer) EncodeChat(chat tokenize.Chat) (prompt string, ids []uint32, err error) {
	err = e.ask(func(eng *tokenize.Engine) error {
		prompt, ids, err = eng.EncodeChat(chat)
		return err
	})
	return prompt, ids, err
}
