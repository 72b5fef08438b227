package kvevents

// sequencer is the subscriber's memory of the sequence numbers it has
// delivered, and the rules that turn a live sequence number into a decision.
// It holds no sockets: the Subscriber feeds it and performs what it decides.
type sequencer struct {
	have     bool   // some batch has been delivered since the last reset
	last     uint64 // sequence number of the last delivered batch
	lastHash uint64 // hash of that batch's payload, to recognise it in a replay

	// lastLive is the highest sequence number received live on the current
	// connection (or, right after a reconnect, the last delivered one). A
	// publisher numbers its messages 0, 1, 2, …, so a live number at or below
	// it means the publisher started over.
	liveValid bool
	lastLive  uint64
}

type verdict uint8

const (
	vNext      verdict = iota // the batch after the last one: deliver it
	vDuplicate                // already delivered (by a replay): drop it
	vRestart                  // the publisher restarted: reset, then catch up
	vCatchUp                  // batches are missing before it (or nothing was delivered yet)
)

func (q *sequencer) live(seq uint64) verdict {
	switch {
	case q.liveValid && seq <= q.lastLive:
		return vRestart
	case q.have && seq <= q.last:
		return vDuplicate
	case q.have && seq == q.last+1, !q.have && seq == 0:
		return vNext // nothing can precede seq 0
	}
	return vCatchUp
}

// sawLive records a live sequence number.
func (q *sequencer) sawLive(seq uint64) { q.liveValid, q.lastLive = true, seq }

// reconnected starts a new connection: the publisher on the other end may
// have restarted, which its first number at or below the last delivered one
// would show.
func (q *sequencer) reconnected() { q.liveValid, q.lastLive = q.have, q.last }

// liveAfresh drops the threshold reconnected set, after a reset: the
// publisher's numbers say nothing of a restart until it has sent one.
func (q *sequencer) liveAfresh() { q.liveValid = false }

func (q *sequencer) delivered(seq, payloadHash uint64) {
	q.have, q.last, q.lastHash = true, seq, payloadHash
}

func (q *sequencer) forget() { q.have = false }

// replayStart is where a catch-up replay begins: at the last delivered batch
// when there is one, so the first reply proves the ring still continues our
// history (same number, same bytes); at 0 otherwise.
func (q *sequencer) replayStart() (from uint64, verify bool) {
	if q.have {
		return q.last, true
	}
	return 0, false
}

// resumption is what the first reply of a replay from the last delivered
// batch says about the ring that sent it.
type resumption uint8

const (
	rUnknown   resumption = iota // no reply judged: none came, or nothing to continue
	rContinues                   // the ring continues our history
	rRestarted                   // other bytes under our last number: another publisher
	rShort                       // the ring does not reach back to what is needed
)

// resumes judges that first reply (its number and payload hash). Our last
// batch itself, same bytes, proves the ring belongs to the publisher we
// followed. The batch after it fills a gap just as well but proves nothing:
// a restarted publisher whose ring moved past our last number holds one
// under that number too. So it counts only with trustNext, when the caller
// already knows the publisher is the one that sent our last batch.
func (q *sequencer) resumes(seq, payloadHash uint64, trustNext bool) resumption {
	switch {
	case seq == q.last && payloadHash == q.lastHash:
		return rContinues
	case seq == q.last:
		return rRestarted
	case seq == q.last+1 && trustNext:
		return rContinues
	}
	return rShort
}
