package kvevents_test

import (
	"fmt"

	"github.com/kvmesh/kvmesh/kvevents"
)

func ExampleDecodeBatch() {
	// What vLLM v0.26 publishes for one stored block, built here with the
	// package's own encoder (a subscriber gets it as the third ZMQ frame).
	payload := kvevents.AppendBatch(nil, &kvevents.Batch{
		TS:     1789095808.5,
		DPRank: 0,
		Events: []kvevents.Event{{
			Kind:        kvevents.KindBlockStored,
			BlockHashes: []uint64{15760518052499183552},
			TokenIDs:    []uint32{151644, 872, 198, 9064},
			BlockSize:   4,
			Medium:      "GPU",
		}},
	}, kvevents.FormatVLLMMap)

	var batch kvevents.Batch // reuse one Batch: decoding then allocates nothing
	if err := kvevents.DecodeBatch(payload, &batch); err != nil {
		fmt.Println("bad payload:", err)
		return
	}
	for _, ev := range batch.Events {
		fmt.Println(ev.Kind, ev.BlockHashes, ev.HasParent, ev.TokenIDs, ev.Medium)
	}

	err := kvevents.DecodeBatch([]byte{0x92, 0x00, 0x91, 0x91, 0x05}, &batch)
	fmt.Println(err)
	// Output:
	// BlockStored [15760518052499183552] false [151644 872 198 9064] GPU
	// kvevents: decode event 0 field type at byte 4: want string, got integer
}
