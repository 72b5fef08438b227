package gateway

import (
	"errors"
	"sync"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/tokenize"
)

// EngineTokenizer returns a tokenizer that asks a live replica serving model
// for its /tokenize answer (the `engine` tokenizer spec): exact for any
// model, at a round trip per uncached prompt. It prefers the first online
// replica in name order so that answers cache in one place. apiKey, when
// set, is sent as a bearer token (engines started with an API key).
func EngineTokenizer(table *fleet.Table, model, apiKey string) tokenize.Model {
	return &engineTokenizer{table: table, model: model, apiKey: apiKey, byURL: map[string]*tokenize.Engine{}}
}

type engineTokenizer struct {
	table  *fleet.Table
	model  string
	apiKey string

	mu    sync.Mutex
	byURL map[string]*tokenize.Engine
}

var errNoEngine = errors.New("no live replica to tokenize with")

func (e *engineTokenizer) engine() (*tokenize.Engine, error) {
	snap := e.table.Snapshot()
	for i := range snap.Replicas {
		r := &snap.Replicas[i]
		if !r.Online || !r.Serves(e.model) || r.URL == "" {
			continue
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		eng := e.byURL[r.URL]
		if eng == nil {
			eng = tokenize.NewEngine(r.URL, e.model, tokenize.WithEngineAPIKey(e.apiKey))
			e.byURL[r.URL] = eng
		}
		return eng, nil
	}
	return nil, errNoEngine
}

func (e *engineTokenizer) Encode(text string, addSpecialTokens bool) ([]uint32, error) {
	eng, err := e.engine()
	if err != nil {
		return nil, err
	}
	return eng.Encode(text, addSpecialTokens)
}

func (e *engineTokenizer) EncodeChat(chat tokenize.Chat) (string, []uint32, error) {
	eng, err := e.engine()
	if err != nil {
		return "", nil, err
	}
	return eng.EncodeChat(chat)
}
