"""A peer on a worker address that completes the handshake, then floods
Ping frames: ``python tests/ping_flooder.py`` prints its address, serves
one LB connection, floods for at most ``SECONDS`` or until the LB hangs
up, then prints how many Pings it sent."""

import socket
import sys
import time

from zc_lb.wire import decoder, frames, protocol
from zc_lb.wire.encoder import encode
from zc_lb.wire.frames import Ping

SECONDS = 10.0


def main() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    print("flooder listening on 127.0.0.1:%d" % server.getsockname()[1], flush=True)
    server.settimeout(30)
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(10)
    peer = protocol.Connection("worker", features=frames.WORKER_FEATURES)
    sock.sendall(peer.data_to_send())
    ready = False
    while not ready:
        data = sock.recv(65536)
        if not data:
            sys.exit("the LB hung up in the handshake")
        peer.receive_data(data)
        while True:
            event = peer.next_event()
            if event is decoder.NEED_DATA:
                break
            ready = ready or isinstance(event, protocol.Ready)
        out = peer.data_to_send()
        if out:
            sock.sendall(out)
    burst = encode(Ping()) * 8192
    sent, deadline = 0, time.monotonic() + SECONDS
    sock.settimeout(1)
    try:
        while time.monotonic() < deadline:
            sock.sendall(burst)
            sent += 8192
    except OSError:
        pass  # the LB dropped us
    print("sent %d" % sent, flush=True)


if __name__ == "__main__":
    main()
