"""ZMQ helpers for the vllm-sim tests (imported by conftest.py and the tests)."""

import queue
import threading

import msgpack
import zmq


class Sub:
    """A pyzmq SUB socket that receives from the start in a background thread (a binding libzmq SUB
    only sends its subscription while it is being read)."""

    def __init__(self, bind: bool = True, connect: str | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self.sock.connect(connect)
            self.endpoint = connect
        self.q: queue.Queue = queue.Queue()
        self.stop_ev = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop_ev.is_set():
            if poller.poll(50):
                self.q.put(self.sock.recv_multipart())

    def get(self, timeout: float = 5.0):
        """Next message as (topic, seq, [ts, events, rank])."""
        topic, seq, payload = self.q.get(timeout=timeout)
        return topic.decode(), int.from_bytes(seq, "big"), decode(payload)

    def events(self, until, timeout: float = 5.0):
        """Collect decoded events until predicate(all_events) is true."""
        got = []
        msgs = []
        while not until(got):
            topic, seq, batch = self.get(timeout)
            msgs.append((topic, seq, batch))
            got.extend(batch[1])
        return got, msgs

    def close(self):
        self.stop_ev.set()
        self.t.join(timeout=2)
        self.sock.close()
        self.ctx.term()


def decode(payload: bytes):
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)
