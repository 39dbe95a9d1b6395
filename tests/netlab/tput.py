"""Bulk TCP throughput between two addresses: ``tput.py srv ADDR N`` / ``tput.py cli ADDR N``.

The client sends N bytes and waits for the server's one-byte acknowledgement, so
the time covers the whole transfer, then prints the goodput in Mbit/s.
"""

import socket
import sys
import time

PORT = 5001


def main(mode: str, addr: str, n: int) -> None:
    if mode == "srv":
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, PORT))
        s.listen(1)
        c, _ = s.accept()
        got = 0
        while got < n:
            b = c.recv(1 << 20)
            if not b:
                break
            got += len(b)
        c.sendall(b"x")
        c.close()
        return
    for _ in range(100):  # the server may still be starting
        try:
            s = socket.create_connection((addr, PORT), timeout=30)
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    t0 = time.perf_counter()
    s.sendall(b"\0" * n)
    s.recv(1)
    print(f"{n * 8 / (time.perf_counter() - t0) / 1e6:.1f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
