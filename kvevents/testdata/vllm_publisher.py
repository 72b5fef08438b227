"""A stand-in for vLLM's ZmqEventPublisher on real libzmq (pyzmq), for
kvevents' interop test. Framing and replay follow kv-events.md section 1.5:
PUB [topic, seq8 BE, payload]; ROUTER replay answering [id, "", start8] with
every retained batch from start on, then an end marker. msgpack's packer
picks the same smallest encodings as msgspec for these types.

Usage: vllm_publisher.py PUB_ENDPOINT REPLAY_ENDPOINT LAYOUT FORMAT N SKIP [PUB_MODE]
  LAYOUT new: replies ["", topic, seq8, payload], end ["", "", FF*8, ""]
         old: replies ["", seq8, payload],        end ["", FF*8, ""]
  FORMAT map (v0.26 events) or array (older events)
  SKIP   comma-separated sequence numbers kept in the ring but not sent live
  PUB_MODE bind (default) or connect: connect dials a subscriber that binds,
         and waits for its subscription before printing "ready"
Prints "ready", publishes after reading a line, prints "done", exits at EOF.
"""
import sys
import threading

import msgpack
import zmq

pub_ep, replay_ep, layout, fmt, n, skip = sys.argv[1:7]
pub_mode = sys.argv[7] if len(sys.argv) > 7 else "bind"
n = int(n)
skip = {int(s) for s in skip.split(",") if s}
topic = b"kv@127.0.0.1@model"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
tokens = [151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667]

ctx = zmq.Context()
if pub_mode == "connect":
    # XPUB publishes as PUB does and also shows the subscription arriving.
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(pub_ep)
else:
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(pub_ep)
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router.bind(replay_ep)
ring = []
lock = threading.Lock()


def payload(seq):
    if fmt == "map":
        ev = {"type": "BlockStored", "block_hashes": [seq], "parent_block_hash": None,
              "token_ids": tokens, "block_size": 16, "lora_id": None, "medium": "GPU",
              "lora_name": None, "extra_keys": [None], "group_idx": 0,
              "kv_cache_spec_kind": "full_attention"}
    else:
        ev = ["BlockStored", [seq], None, tokens, 16, None, "GPU", None]
    return msgpack.packb([float(seq), [ev], 0])


def serve_replay():
    while True:
        try:
            frames = router.recv_multipart()
        except zmq.ZMQError:
            return
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            continue
        ident, start = frames[0], int.from_bytes(frames[2], "big")
        with lock:
            items = [(s, p) for s, p in ring if s >= start]
        for s, p in items:
            if layout == "new":
                router.send_multipart([ident, b"", topic, s.to_bytes(8, "big"), p])
            else:
                router.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
        if layout == "new":
            router.send_multipart([ident, b"", b"", END_SEQ, b""])
        else:
            router.send_multipart([ident, b"", END_SEQ, b""])


threading.Thread(target=serve_replay, daemon=True).start()
if pub_mode == "connect":
    pub.recv()  # the subscription
print("ready", flush=True)
sys.stdin.readline()
for seq in range(n):
    p = payload(seq)
    with lock:
        ring.append((seq, p))
    if seq not in skip:
        pub.send_multipart([topic, seq.to_bytes(8, "big"), p])
print("done", flush=True)
sys.stdin.read()  # until the test closes stdin
