"""A TCP proxy process for fault tests: ``python tcp_proxy.py LISTEN_PORT TARGET_HOST TARGET_PORT``.

Killing the process drops every connection through it at once, as a database failover or a
network cut would; starting it again on the same port brings the path back. SIGUSR1 makes it
hold instead: every connection stays open and new ones are accepted, but nothing is relayed
either way, as a frozen host or a stuck middlebox would (the kernel still acknowledges every
byte, so neither TCP keepalives nor user timeouts notice). SIGUSR2 lets traffic flow again.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

flowing = threading.Event()
flowing.set()


def pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            while not flowing.is_set():  # held: keep the bytes, relay nothing
                time.sleep(0.05)
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listen_port: int, target_host: str, target_port: int) -> None:
    signal.signal(signal.SIGUSR1, lambda *_: flowing.clear())
    signal.signal(signal.SIGUSR2, lambda *_: flowing.set())
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", listen_port))
    server.listen(128)
    print("listening", flush=True)
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection((target_host, target_port))
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
