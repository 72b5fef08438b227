package gateway

import (
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/chatconv"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/storedchain"
)

// storedOutputTimeout bounds the read of a stored response's output a
// follow-up's prediction needs; past it the follow-up goes on unpredicted.
const storedOutputTimeout = 250 * time.Millisecond

// continuation rebuilds the prompt of p, a follow-up of the stored
// response engineID on replica, from the state its id carried (package
// storedchain) and the stored output the replica serves: what the plan
// predicts its cached tokens from, and the state its own answer's ids
// carry. Anything missing leaves both nil: the follow-up is served all the
// same, with no prediction.
func (g *Gateway) continuation(s *Settings, snap *fleet.Snapshot, p *request.Request, replica, engineID string, carried []byte) (*storedchain.Continued, []byte) {
	if carried == nil {
		return nil, nil
	}
	st, err := storedchain.Decode(carried)
	if err != nil {
		return nil, nil
	}
	i := snap.Find(replica)
	if i < 0 {
		return nil, nil
	}
	r := &snap.Replicas[i]
	ms := s.planModel(p.Model, s.Models[p.Model])
	if ms.Tokenizer == nil {
		return nil, nil
	}
	seed := blockkey.Seed(ms.Adapter, p.CacheSalt)
	if storedchain.Fingerprint(p, seed) != st.Fingerprint {
		return nil, nil // the stored history renders otherwise now: no read
	}
	up, err := g.upstream(r)
	if err != nil {
		return nil, nil
	}
	status, body, err := up.Get(string(responsesPrefix)+engineID, storedOutputTimeout)
	if err != nil || status != 200 {
		return nil, nil
	}
	outputs, err := chatconv.StoredOutputs(body)
	if err != nil {
		return nil, nil
	}
	c, next, err := storedchain.Continue(ms.Tokenizer, p, seed, st, outputs, r.BlockSize)
	if err != nil {
		return nil, nil
	}
	if !p.Store {
		return &c, nil
	}
	return &c, next.Encode()
}

// beginChain returns the state the ids of l's answer carry when its
// request starts a stored conversation, nil when there is none to carry.
func (l *ledger) beginChain() []byte {
	p, pl := l.req, &l.plan
	pr := &pl.Prompt
	if p.Kind != request.Responses || !p.Store || p.PreviousResponseID != "" ||
		pr.Err != nil || pr.Estimated || pr.MediaPrefix || len(pr.IDs) != pr.Tokens {
		return nil
	}
	ms := l.s.planModel(l.model, l.s.Models[l.model])
	if ms.Tokenizer == nil {
		return nil
	}
	st, err := storedchain.Begin(ms.Tokenizer, p, blockkey.Seed(ms.Adapter, p.CacheSalt), pr.IDs, pl.Request.BlockSize)
	if err != nil {
		return nil
	}
	return st.Encode()
}
