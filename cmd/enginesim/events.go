package main

import (
	"fmt"

	"github.com/kvmesh/kvmesh/engine"
)

// eventSink owns the KV-event publisher, if any.
type eventSink struct {
	pub engine.EventSink
}

func newEventSink(o options) (*eventSink, error) {
	if o.kvEvents == "" {
		if o.kvReplay != "" {
			return nil, fmt.Errorf("--kv-replay needs --kv-events")
		}
		return &eventSink{}, nil
	}
	return nil, fmt.Errorf("--kv-events: the ZMQ publisher (kvevents.NewPublisher) is not in this build yet")
}

func (s *eventSink) sink() engine.EventSink { return s.pub }

func (s *eventSink) Close() {}
