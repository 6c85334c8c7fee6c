"""A TCP proxy process for fault tests: ``python tcp_proxy.py LISTEN_PORT TARGET_HOST TARGET_PORT``.

Killing the process drops every connection through it at once, as a database failover or a
network cut would; starting it again on the same port brings the path back. SIGUSR1 turns it
into a black hole instead: every connection stays open and new ones are accepted, but what
arrives is read and dropped, as a frozen host behind a middlebox would do (the kernel still
acknowledges every byte, so neither TCP keepalives nor user timeouts notice). SIGUSR2 lets new
connections through again; those opened before stay black holes for good.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

flowing = threading.Event()
flowing.set()
opened_since_flowing = [0.0]  # connections opened before this time (or while held) drop everything


def pipe(source: socket.socket, sink: socket.socket, opened_at: float) -> None:
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            if not flowing.is_set() or opened_at < opened_since_flowing[0]:
                continue  # a black hole: read, drop, answer nothing
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
    def hold(*_):
        flowing.clear()

    def release(*_):
        opened_since_flowing[0] = time.monotonic()
        flowing.set()

    signal.signal(signal.SIGUSR1, hold)
    signal.signal(signal.SIGUSR2, release)
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
        opened_at = time.monotonic() if flowing.is_set() else float("-inf")
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b, opened_at), daemon=True).start()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
