"""The links' counters measure what crossed them: a known message, bounded from both sides."""

import subprocess
import sys
import time

from gradsync.netlab import Netlab
from gradsync.netlab.links import tcp_wire_bytes

N = 3_000_000
SERVER = ("import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, "
          "socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0', 5555))\ns.listen()\nc, _ = s.accept()\n"
          "n = 0\nwhile True:\n    b = c.recv(1 << 16)\n    if not b:\n        break\n"
          "    n += len(b)\nprint(n)")
CLIENT = ("import socket, sys\nc = socket.create_connection((sys.argv[1], 5555))\n"
          f"c.sendall(b'x' * {N})\nc.close()")


def test_a_known_message_counts_its_payload_plus_at_most_one_header_a_segment():
    with Netlab(2, "1gbit") as lab:
        a, b = lab.hosts
        server = lab.popen(b, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # listening
        before = lab.link_bytes()
        subprocess.run(["ip", "netns", "exec", a.netns, sys.executable, "-c", CLIENT, b.addr],
                       check=True, timeout=60)
        got = server.communicate(timeout=60)[0].strip()
        after = lab.link_bytes()
    assert got == str(N)
    sent = after[0][0] - before[0][0]
    received = after[1][1] - before[1][1]
    assert N < sent <= tcp_wire_bytes(N) + 10 * 74  # + handshake and close frames
    assert abs(sent - N) / N < 0.05  # within 5% of the message
    # one link: what one end sent, the other received (give or take a frame of the
    # hosts' own chatter, IPv6 neighbour discovery, counted on one side only: seen 90 B)
    assert abs(received - sent) < 1000, (received, sent)
    acks = after[0][1] - before[0][1]
    assert 0 < acks < 0.05 * N  # the other way only acknowledgements
