package kvevents

import (
	"bytes"
	"errors"
	"runtime"
	"testing"
)

// tinyEvents is a batch of n events of two bytes each ([""], an unknown
// tag): the most events a payload can hold.
func tinyEvents(n int) []byte {
	b := appendArrayHeader([]byte{0x92, 0x00}, n)
	return append(b, bytes.Repeat([]byte{0x91, 0xa0}, n)...)
}

func TestBatchOfTooManyEventsIsRefusedBeforeDecoding(t *testing.T) {
	var b Batch
	if err := DecodeBatch(tinyEvents(MaxBatchEvents), &b); err != nil || len(b.Events) != MaxBatchEvents {
		t.Fatalf("%d events: %v (%d decoded)", MaxBatchEvents, err, len(b.Events))
	}
	// 4 M events in 8 MB once decoded into 3.4 GB of Events; now nothing
	// is allocated for them.
	payload := tinyEvents(4 << 20)
	// TotalAlloc is process-wide: goroutines other tests left behind
	// allocate too, so take the least of a few tries and allow far less
	// than one decoded event per thousand refused.
	grown := ^uint64(0)
	for range 3 {
		var fresh Batch
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		err := DecodeBatch(payload, &fresh)
		runtime.ReadMemStats(&after)
		var de *DecodeError
		if !errors.As(err, &de) || de.Field != "events" {
			t.Fatalf("4M events: %v, want a DecodeError on events", err)
		}
		grown = min(grown, after.TotalAlloc-before.TotalAlloc)
	}
	if grown > 64<<10 {
		t.Fatalf("refusing 4M events allocated %d bytes", grown)
	}
	t.Logf("refusing 4M events allocated %d bytes", grown)
}

// An outlier batch grows the reused buffers; the next decode drops them,
// so one outlier does not keep its memory.
func TestOutlierBuffersAreDroppedOnTheNextDecode(t *testing.T) {
	big := Batch{DPRank: -1}
	for i := range 20_000 {
		big.Events = append(big.Events, Event{Kind: KindBlockStored, BlockHashes: []uint64{uint64(i + 1)}, TokenIDs: make([]uint32, 64), BlockSize: 64})
	}
	small := Batch{DPRank: -1, Events: []Event{{Kind: KindBlockRemoved, BlockHashes: []uint64{7}}}}
	bigWire, smallWire := AppendBatch(nil, &big, FormatVLLMArray), AppendBatch(nil, &small, FormatVLLMArray)

	var b Batch
	for range 3 { // steady small batches keep their buffers
		if err := DecodeBatch(smallWire, &b); err != nil {
			t.Fatal(err)
		}
	}
	steady := &b.Events[0]
	if err := DecodeBatch(smallWire, &b); err != nil || &b.Events[0] != steady {
		t.Fatalf("a steady batch did not reuse its buffers: %v", err)
	}
	if err := DecodeBatch(bigWire, &b); err != nil || len(b.Events) != 20_000 {
		t.Fatalf("outlier: %v", err)
	}
	if !b.Outsized() {
		t.Fatalf("outlier holds %d bytes, not outsized (limit %d)", b.held, maxRetainedBytes)
	}
	outlier := b.held
	if err := DecodeBatch(smallWire, &b); err != nil || !batchEqual(&b, &small) {
		t.Fatalf("after the outlier: %v %+v", err, b)
	}
	if cap(b.Events) > 4 || b.held > 1<<10 || b.Outsized() {
		t.Fatalf("after the outlier: %d slots, %d bytes held (outlier held %d)", cap(b.Events), b.held, outlier)
	}
	t.Logf("outlier held %d KiB, the next batch %d B", outlier>>10, b.held)
}
