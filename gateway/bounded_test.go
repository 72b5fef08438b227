package gateway

import (
	"runtime"
	"testing"

	"github.com/kvmesh/kvmesh/request"
)

// TestDecisionBoundedOnHugeBodies: deciding on the largest bodies of each
// shape (one prompt, one message, as many messages as fit) allocates a few
// MB whatever the body's size, as only max_prefix_bytes of the prompt are
// rendered and tokenized — before, it allocated 2 to 30 times the body (a
// 64 MiB body: 134 MB to 1.9 GB) — and still matches max_prefix_tokens
// tokens while counting the whole prompt roughly.
func TestDecisionBoundedOnHugeBodies(t *testing.T) {
	const size = 16 << 20
	bodies := maxBodies(size)
	for name, tk := range maxBodyTokenizers(t) {
		g := benchGateway(t, tk)
		s := g.Settings()
		for _, shape := range bodies {
			p, err := request.Parse(shape.body, shape.kind)
			if err != nil {
				t.Fatal(err)
			}
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			ex := g.getExchange(s)
			ex.model = "llama"
			if err := ex.decide(g.table.Snapshot(), p); err != nil {
				t.Fatal(err)
			}
			runtime.ReadMemStats(&after)
			allocated := after.TotalAlloc - before.TotalAlloc
			if allocated > 8<<20 {
				t.Errorf("%s/%s: the decision allocated %d MB", name, shape.name, allocated>>20)
			}
			// A token takes 2 to 8 bytes of these bodies.
			if pr := ex.plan.Prompt; pr.Err != nil || !pr.Estimated || len(pr.IDs) != s.MaxPrefixTokens ||
				pr.Tokens < size/8 || pr.Tokens > size/2 {
				t.Errorf("%s/%s: %d ids, %d prompt tokens (estimated %v), %v", name, shape.name, len(pr.IDs), pr.Tokens, pr.Estimated, pr.Err)
			}
			g.putExchange(ex)
		}
	}
}
