package fleetsim

import "github.com/kvmesh/kvmesh/loadtest/workload"

// promptCache tokenizes each distinct prompt (workload Key) once and keeps
// its ids only while requests for it are still to arrive, so memory follows
// the prompts in use, not the whole workload.
type promptCache struct {
	w    *workload.Workload
	tok  *workload.Tokenizer
	left map[string]int
	ids  map[string][]uint32
}

func newPromptCache(w *workload.Workload) promptCache {
	c := promptCache{w: w, tok: workload.NewTokenizer(w.Requests), left: map[string]int{}, ids: map[string][]uint32{}}
	for i := range w.Requests {
		c.left[w.Requests[i].Key]++
	}
	return c
}

// get returns request k's prompt ids: the chat rendered with the builtin
// template, as router and enginesim compute them.
func (c *promptCache) get(k int) ([]uint32, error) {
	r := &c.w.Requests[k]
	ids, ok := c.ids[r.Key]
	if !ok {
		var err error
		if ids, err = c.tok.Tokenize(r.Messages); err != nil {
			return nil, err
		}
	}
	if c.left[r.Key]--; c.left[r.Key] <= 0 {
		delete(c.ids, r.Key)
		delete(c.left, r.Key)
	} else {
		c.ids[r.Key] = ids
	}
	return ids, nil
}
