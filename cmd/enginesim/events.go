package main

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/kvevents"
)

// newPublishers opens one KV-event publisher per data-parallel rank, on
// the endpoints vLLM's rank would use, or returns nil when --kv-events is
// empty.
func newPublishers(o options, log zerolog.Logger) (rankPublishers, error) {
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
	// Every rank's endpoints first, so a bad one opens no socket.
	n := max(o.dataParallelSize, 1)
	endpoints, replays := make([]string, n), make([]string, n)
	for r := range n {
		if endpoints[r], err = offsetEndpointPort(o.kvEvents, r); err == nil {
			replays[r], err = offsetEndpointPort(o.kvReplay, r)
		}
		if err != nil {
			return nil, fmt.Errorf("--data-parallel-size %d: %w", n, err)
		}
	}
	var pubs rankPublishers
	for r := range n {
		p, err := kvevents.NewPublisher(kvevents.PublisherConfig{
			Endpoint:       endpoints[r],
			ReplayEndpoint: replays[r],
			Topic:          o.kvTopic,
			Format:         format,
			Logger:         log.With().Int("data_parallel_rank", r).Logger(),

			MaxMessageBytes:  o.kvMaxMessageBytes,
			HandshakeTimeout: o.kvHandshakeTimeout,
		})
		if err != nil {
			pubs.Close()
			return nil, fmt.Errorf("KV events of data-parallel rank %d: %w", r, err)
		}
		pubs = append(pubs, p)
	}
	return pubs, nil
}

// rankPublishers are the ranks' publishers in rank order. As one event
// sink they send each batch on the publisher of the rank it is stamped
// with: every rank has its own socket, as every vLLM DP rank has.
type rankPublishers []*kvevents.Publisher

// Publish sends b on its rank's publisher.
func (ps rankPublishers) Publish(b *kvevents.Batch) error {
	if b.DPRank < 0 || b.DPRank >= len(ps) {
		return fmt.Errorf("KV-event batch of data-parallel rank %d, publishers for %d", b.DPRank, len(ps))
	}
	return ps[b.DPRank].Publish(b)
}

// Close closes every publisher.
func (ps rankPublishers) Close() {
	for _, p := range ps {
		_ = p.Close()
	}
}

// sink hands the server a nil interface, not a typed nil, when events are off.
func sink(ps rankPublishers) engine.EventSink {
	if ps == nil {
		return nil
	}
	return ps
}

// offsetEndpointPort is vLLM's ZmqEventPublisher.offset_endpoint_port
// (vllm/distributed/kv_events.py, commit 0181ea31), applied to the event
// and replay endpoints alike: rank r > 0 of a data-parallel engine
// publishes on the configured TCP port plus r, or on an inproc name
// suffixed _dp<r>; rank 0, and a TCP endpoint without a port, keep the
// endpoint as given; any other transport (ipc://) cannot be shifted and is
// an error, as in vLLM.
func offsetEndpointPort(endpoint string, rank int) (string, error) {
	if endpoint == "" || rank == 0 {
		return endpoint, nil
	}
	switch {
	case strings.Contains(endpoint, "inproc"):
		return fmt.Sprintf("%s_dp%d", endpoint, rank), nil
	case strings.Contains(endpoint, "tcp"):
		i := strings.LastIndexByte(endpoint, ':')
		if i < 0 {
			return endpoint, nil
		}
		port, err := strconv.Atoi(strings.TrimSpace(endpoint[i+1:]))
		if err != nil {
			return "", fmt.Errorf("endpoint %q: port is not a number", endpoint)
		}
		return endpoint[:i] + ":" + strconv.Itoa(port+rank), nil
	}
	return "", fmt.Errorf("endpoint %q: data-parallel rank %d needs a tcp:// or inproc:// endpoint, whose port or name is shifted by rank", endpoint, rank)
}
