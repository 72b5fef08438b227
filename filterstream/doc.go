// Package filterstream is the protocol that carries each sidecar's view of
// its engine to every router: how busy the engine is, and which KV-cache
// blocks it holds, as a Bloom filter of their keys. It holds the messages,
// their encoding, the members' metadata, and the two sides of the protocol
// as state machines of plain values — a Sender (sidecar) and a Receiver
// (router) — fed messages, membership and the time, and answering with an
// Output: messages to send and what happened. Nothing here opens a socket,
// reads the clock, starts a goroutine, logs or counts metrics; package
// gossip carries the bytes over memberlist, tells the machines who is in the
// cluster, and counts and logs what they report.
//
// # How a sidecar's filter reaches a router
//
// A sidecar keeps the exact set of its engine's resident blocks and, beside
// it, a bloom.Generations: a filter of their keys that is rebuilt from the
// set now and then (evictions cannot be taken out of a Bloom filter) and
// grows between rebuilds. Three numbers name a filter state:
//
//   - the epoch, drawn at random when the sidecar starts or its engine
//     restarts: nothing held for another epoch is true any more;
//   - the generation, counting rebuilds within the epoch;
//   - the sequence, counting deltas (keys added) within the generation.
//
// The Sender, every flush (25 ms), takes the keys added since the last one
// as a delta and sends it to every router as a datagram (KindDelta). When
// the generation changes it asks its caller for a snapshot of the whole
// filter to each router, over a stream (KindSnapshot; SnapshotMessage), one
// at a time per router. Every 100 ms it sends each router a load record
// (KindLoad): engine health, queue, KV usage, the other routers' in-flight
// work there, and the generation and sequence of the last filter message —
// so a router notices a lost trailing delta without waiting for the next.
//
// The Receiver mirrors each sidecar's filter (bloom.Mirror) and hands it to
// the router's fleet.Table, where routing matches prompts against it:
//
//   - A snapshot replaces what is held unless it is older. Deltas apply in
//     order; one that arrives before its generation's snapshot (datagrams
//     overtake streams) is kept and replayed when the snapshot lands.
//   - A hole in the current generation, or three load records in a row
//     announcing state the mirror lacks, makes it send a resync (KindResync,
//     rate-limited, backing off): first "I hold generation G up to sequence
//     S", which the Sender answers with the deltas it still keeps; when that
//     does not help, or nothing is held, "send a snapshot".
//   - The load record is the authority on the epoch: a new epoch wipes the
//     mirror, and a late message of another epoch, or a late load record of
//     an epoch left, is ignored.
//   - A sidecar that falls silent drops out of prefix routing (the table's
//     expiry, driven by Tick); the mirror keeps its filter and shows it again
//     once a load record proves it current. An unhealthy load record takes
//     the filter down at once. A sidecar that leaves sends its leaving record
//     three times (a datagram) and its replica leaves the table; one that
//     just disappears leaves its replica routed by load (an orphan).
//
// A route clear (KindClearRoutes, from an operator at one router) drops the
// named replicas' filters at every router and makes their sidecars rebuild:
// each router then ignores filter state older than the generation after the
// one it held, until the fresh one arrives or 3 s pass.
//
// Routers also report, every other tick, their in-flight work at each replica
// (KindInflight); the sidecar sums the live reports into its load records,
// leaving out the recipient's own share when it announces CapInflightOthers,
// so every router sees the work the others sent there.
//
// Routers that announce CapTenantUsage also send each other their
// per-tenant usage over the last minute (KindTenantUsage, every 500 ms),
// which package quota turns into quotas kept across routers.
//
// # Wire format
//
// A message is the magic byte 'k', the wire version (1), the kind, the
// sender's member name, its epoch (8 bytes little-endian), a sequence
// (uvarint), then the kind's fields; snapshots and deltas carry bloom's own
// encoding. Metadata (Meta, at most MetaMaxSize bytes, gossiped by
// memberlist) announces a member's role, names, block size, key scheme and
// capability bits: a member never sends what its peer did not say it reads.
// testdata/wire holds every message kind and metadata record as released
// builds encode them; the tests decode each to the same values and encode
// the same bytes.
package filterstream
