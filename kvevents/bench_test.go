package kvevents

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/rs/zerolog"
	"github.com/vmihailenco/msgpack/v5"
)

// BenchmarkDecodeBlockStored decodes batches of 32 BlockStored events, one
// 16-token block each (Qwen-sized token ids, uint64 hashes, a parent), the
// shape vLLM publishes per scheduler step, into a reused Batch.
func BenchmarkDecodeBlockStored(b *testing.B) {
	const perBatch = 32
	batch := Batch{TS: exampleTS, DPRank: 0}
	for i := range perBatch {
		batch.Events = append(batch.Events, Event{Kind: KindBlockStored,
			BlockHashes: []uint64{exampleHash ^ uint64(i)}, HasParent: true, ParentHash: uint64(i) << 48,
			TokenIDs: exampleTokens, BlockSize: 16, Medium: "GPU", ExtraKeys: []byte{0x91, 0xc0},
			HasGroupIdx: true, SpecKind: "full_attention"})
	}
	for _, f := range []Format{FormatVLLMMap, FormatVLLMArray, FormatSGLang} {
		payload := AppendBatch(nil, &batch, f)
		b.Run(f.String(), func(b *testing.B) {
			var into Batch
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				if err := DecodeBatch(payload, &into); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*perBatch)/b.Elapsed().Seconds(), "events/s")
			b.ReportMetric(float64(testing.AllocsPerRun(10, func() { _ = DecodeBatch(payload, &into) }))/perBatch, "allocs/event")
		})
	}
}

// BenchmarkAppendBatch is the publisher's encoding cost for the same batch.
func BenchmarkAppendBatch(b *testing.B) {
	batch := Batch{TS: exampleTS, DPRank: 0}
	for i := range 32 {
		batch.Events = append(batch.Events, Event{Kind: KindBlockStored, BlockHashes: []uint64{uint64(i)},
			TokenIDs: exampleTokens, BlockSize: 16, Medium: "GPU"})
	}
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		buf = AppendBatch(buf[:0], &batch, FormatVLLMMap)
	}
	b.ReportMetric(float64(b.N*32)/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkPubSubLoopback pushes batches of 32 one-block BlockStored events
// from a Publisher to a Subscriber over loopback TCP and reports delivered
// batches and events per second end to end (both ends in this process).
func BenchmarkPubSubLoopback(b *testing.B) {
	p, err := newPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Logger: zerolog.Nop()}, true)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	var delivered atomic.Uint64
	h := countingHandler{&delivered}
	s := NewSubscriber(SubscriberConfig{Endpoint: p.Endpoint(), Logger: zerolog.Nop()}, h)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if pub := p.currentPub(); pub != nil && len(pub.(zmq4.Topics).Topics()) > 0 {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("no subscriber")
		}
		time.Sleep(time.Millisecond)
	}
	batch := Batch{TS: exampleTS, DPRank: 0}
	for i := range 32 {
		batch.Events = append(batch.Events, Event{Kind: KindBlockStored, BlockHashes: []uint64{uint64(i)},
			HasParent: true, TokenIDs: exampleTokens, BlockSize: 16, Medium: "GPU"})
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for p.Publish(&batch) == ErrQueueFull {
			time.Sleep(50 * time.Microsecond)
		}
	}
	for deadline := time.Now().Add(30 * time.Second); delivered.Load() < uint64(b.N); {
		if time.Now().After(deadline) {
			b.Fatalf("delivered %d of %d (stats %+v)", delivered.Load(), b.N, s.Stats())
		}
		time.Sleep(100 * time.Microsecond)
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "batches/s")
	b.ReportMetric(float64(b.N*32)/b.Elapsed().Seconds(), "events/s")
}

type countingHandler struct{ n *atomic.Uint64 }

func (h countingHandler) HandleBatch(uint64, *Batch) { h.n.Add(1) }
func (h countingHandler) HandleReset(string)         {}

// BenchmarkDecodeMsgpackV5Baseline decodes the array-form payload of
// BenchmarkDecodeBlockStored with vmihailenco/msgpack/v5's low-level Decoder
// (positional, no tolerance logic), into the same reused Batch: the
// alternative the hand-written reader was measured against.
func BenchmarkDecodeMsgpackV5Baseline(b *testing.B) {
	batch := Batch{TS: exampleTS, DPRank: 0}
	for i := range 32 {
		batch.Events = append(batch.Events, Event{Kind: KindBlockStored,
			BlockHashes: []uint64{exampleHash ^ uint64(i)}, HasParent: true, ParentHash: uint64(i) << 48,
			TokenIDs: exampleTokens, BlockSize: 16, Medium: "GPU"})
	}
	payload := AppendBatch(nil, &batch, FormatVLLMArray)
	var into Batch
	rd := bytes.NewReader(payload)
	d := msgpack.NewDecoder(rd)
	decode := func() error {
		rd.Reset(payload)
		d.Reset(rd)
		if _, err := d.DecodeArrayLen(); err != nil {
			return err
		}
		var err error
		if into.TS, err = d.DecodeFloat64(); err != nil {
			return err
		}
		n, err := d.DecodeArrayLen()
		if err != nil {
			return err
		}
		into.Events = into.Events[:0]
		for range n {
			k := len(into.Events)
			if k < cap(into.Events) {
				into.Events = into.Events[:k+1]
			} else {
				into.Events = append(into.Events, Event{})
			}
			ev := &into.Events[k]
			fields, err := d.DecodeArrayLen()
			if err != nil {
				return err
			}
			if _, err := d.DecodeString(); err != nil {
				return err
			}
			nh, _ := d.DecodeArrayLen()
			ev.BlockHashes = ev.BlockHashes[:0]
			for range nh {
				h, err := d.DecodeUint64()
				if err != nil {
					return err
				}
				ev.BlockHashes = append(ev.BlockHashes, h)
			}
			if ev.ParentHash, err = d.DecodeUint64(); err != nil {
				return err
			}
			nt, _ := d.DecodeArrayLen()
			ev.TokenIDs = ev.TokenIDs[:0]
			for range nt {
				tok, err := d.DecodeUint32()
				if err != nil {
					return err
				}
				ev.TokenIDs = append(ev.TokenIDs, tok)
			}
			if ev.BlockSize, err = d.DecodeInt(); err != nil {
				return err
			}
			for range fields - 5 {
				if err := d.Skip(); err != nil {
					return err
				}
			}
		}
		into.DPRank, err = d.DecodeInt()
		return err
	}
	if err := decode(); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := decode(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*32)/b.Elapsed().Seconds(), "events/s")
	b.ReportMetric(float64(testing.AllocsPerRun(10, func() { _ = decode() }))/32, "allocs/event")
}
