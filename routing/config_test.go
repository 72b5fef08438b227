package routing

import (
	"strings"
	"testing"
	"time"
)

func TestSettingsNoCostModelCanMeanAreRejected(t *testing.T) {
	cases := map[string]Config{
		"prefill_per_token":  {PrefillPerToken: -time.Microsecond},
		"per_running":        {PerRunning: -time.Millisecond},
		"tokens_per_waiting": {TokensPerWaiting: -1},
		"load_bound":         {LoadBound: 0.9},
		"imbalance_exit":     {ImbalanceEnter: 3, ImbalanceExit: 4},
	}
	for want, cfg := range cases {
		for _, name := range Names {
			_, err := New(name, cfg)
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("%s with bad %s: err %v", name, want, err)
			}
			if err := Validate(name, cfg); err == nil {
				t.Errorf("Validate passed %s with bad %s", name, want)
			}
		}
	}
	if _, err := New("kvaware", Config{ImbalanceEnter: 3, ImbalanceExit: 3, LoadBound: 1}); err != nil {
		t.Errorf("edge values rejected: %v", err)
	}
}
