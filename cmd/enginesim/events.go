package main

import (
	"errors"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/kvevents"
)

// newPublisher opens the KV-event publisher the flags ask for, or returns
// nil when --kv-events is empty.
func newPublisher(o options, log zerolog.Logger) (*kvevents.Publisher, error) {
	if o.kvEvents == "" {
		if o.kvReplay != "" {
			return nil, errors.New("--kv-replay needs --kv-events")
		}
		return nil, nil
	}
	format, err := kvevents.ParseFormat(o.kvFormat)
	if err != nil {
		return nil, err
	}
	return kvevents.NewPublisher(kvevents.PublisherConfig{
		Endpoint:       o.kvEvents,
		ReplayEndpoint: o.kvReplay,
		Topic:          o.kvTopic,
		Format:         format,
		Logger:         log,

		MaxMessageBytes:  o.kvMaxMessageBytes,
		HandshakeTimeout: o.kvHandshakeTimeout,
	})
}

// sink hands the server a nil interface, not a typed nil, when events are off.
func sink(p *kvevents.Publisher) engine.EventSink {
	if p == nil {
		return nil
	}
	return p
}
