package gateway

import (
	"encoding/json"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/fleet"
)

// DiscoverStatic asks every static upstream configured without models for
// its /v1/models (served names and LoRA adapters), now and every interval
// until stop closes, so such upstreams route only the models they serve
// and appear in /v1/models. Until an answer comes they take any model.
func (g *Gateway) DiscoverStatic(every time.Duration, stop <-chan struct{}) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		g.RefreshStaticModels()
		select {
		case <-stop:
			return
		case <-t.C:
		}
	}
}

// RefreshStaticModels asks the static upstreams without configured models
// for their models once (DiscoverStatic's step; call it after a reload).
func (g *Gateway) RefreshStaticModels() {
	snap := g.table.Snapshot()
	for i := range snap.Replicas {
		r := &snap.Replicas[i]
		if r.Protocol != fleet.ProtocolStatic || (len(r.Models) > 0 && !r.ModelsLearned) {
			continue // configured models win
		}
		up, err := g.upstream(r)
		if err != nil {
			continue
		}
		status, body, err := up.Get("/v1/models", 2*time.Second)
		if err != nil || status != 200 {
			g.log.Debug().Err(err).Int("status", status).Str("replica", r.Name).Msg("static upstream /v1/models")
			continue
		}
		var list struct {
			Data []struct {
				ID string `json:"id"`
			} `json:"data"`
		}
		if json.Unmarshal(body, &list) != nil || len(list.Data) == 0 {
			continue
		}
		models := make([]string, 0, len(list.Data))
		for _, m := range list.Data {
			if m.ID != "" {
				models = append(models, m.ID)
			}
		}
		slices.Sort(models)
		if slices.Equal(models, r.Models) {
			continue
		}
		if !g.table.LearnStatic(r.Name, r.URL, models) {
			continue // reloaded while it was asked: the new configuration wins
		}
		g.log.Info().Str("replica", r.Name).Strs("models", models).Msg("static upstream models learned")
	}
}
