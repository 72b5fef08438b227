package main

import (
	"strings"
	"testing"
)

func TestFlagErrors(t *testing.T) {
	for args, want := range map[string]string{
		"--gossip-key=bm9wZQ==": "gossip key: 4 bytes",
		"--protocol=tgi":        `--protocol "tgi"`,
		"--kv-events=tcp://127.0.0.1:1 --kv-events-bind=tcp://127.0.0.1:2": "not both",
		"--log-format=xml":    "--log-format",
		"--capacity=18000000": "the largest --capacity at this rate is 16707069",
	} {
		err := run(strings.Fields(args))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want an error containing %q", args, err, want)
		}
	}
	if err := run([]string{"-h"}); err != nil {
		t.Fatalf("-h: %v", err)
	}
}

func TestFlagsFromEnvironment(t *testing.T) {
	t.Setenv("KVMESH_PROTOCOL", "nope")
	if err := run(nil); err == nil || !strings.Contains(err.Error(), `"nope"`) {
		t.Fatalf("KVMESH_PROTOCOL ignored: %v", err)
	}
}
