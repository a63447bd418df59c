#!/usr/bin/env python3
"""Bandwidth and round trip across one emulated link (scripts/cluster.sh measure).

  netbench.py serve ADDR SECONDS    # on the receiving host: accepts one client, then exits
  netbench.py send ADDR SECONDS     # on the sending host: prints "BITS_PER_S RTT_S"

The client first bounces one byte PINGS times (the median is the round trip), then sends
for SECONDS; the receiver times the bytes from the first to the end of the stream (so the
sender's socket buffer does not count as sent) and returns what it saw. Every wait has a
time limit, so a lost peer ends the measurement instead of hanging it.
"""
import socket
import statistics
import sys
import time

PORT = 5201
PINGS = 50
CHUNK = 1 << 20


def serve(addr, seconds):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, PORT))
        s.listen(1)
        s.settimeout(seconds + 10)
        c, _ = s.accept()
        with c:
            c.settimeout(seconds + 10)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(PINGS):
                c.sendall(c.recv(1))
            n, t0 = 0, None
            while True:
                b = c.recv(CHUNK)
                if not b:
                    break
                if t0 is None:
                    t0 = time.monotonic()
                n += len(b)
            c.sendall(b"%d %.9f\n" % (n, time.monotonic() - t0))


def send(addr, seconds):
    c = None
    for _ in range(100):  # the receiver may still be starting: up to 10 s
        try:
            c = socket.create_connection((addr, PORT), timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    if c is None:
        sys.exit(f"netbench: no receiver at {addr}:{PORT}")
    with c:
        c.settimeout(seconds + 10)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(PINGS):
            t = time.monotonic()
            c.sendall(b"x")
            if not c.recv(1):
                sys.exit("netbench: the receiver closed the connection")
            rtts.append(time.monotonic() - t)
        buf = b"\0" * CHUNK
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            c.sendall(buf)
        c.shutdown(socket.SHUT_WR)
        n, t = c.makefile().readline().split()
        print(f"{int(n) * 8 / float(t):.0f} {statistics.median(rtts):.6f}")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("serve", "send"):
        sys.exit("usage: netbench.py serve|send ADDR SECONDS")
    (serve if sys.argv[1] == "serve" else send)(sys.argv[2], float(sys.argv[3]))
