#!/usr/bin/env python3
"""Sends UDP datagrams as several flows that differ only in source port, so
that the fabric's ECMP hash can spread them over the spines.

Usage: udpflows.py BIND_ADDR DST_ADDR DST_PORT COUNT SPORT [SPORT...]
Sends COUNT datagrams per source port (round-robin over the ports), 64-byte
payloads, in small paced bursts so that the veths' per-CPU backlog (1000
packets) never overflows: every loss then comes from the fabric's rules.
Prints the number of datagrams sent.
"""
import socket
import sys
import time


def main() -> int:
    if len(sys.argv) < 6:
        print(__doc__, file=sys.stderr)
        return 2
    bind, dst, dport, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sockets = []
    for sport in sys.argv[5:]:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((bind, int(sport)))
        sockets.append(s)
    payload = b"\x5a" * 64
    sent = 0
    for i in range(count):
        for s in sockets:
            s.sendto(payload, (dst, dport))
            sent += 1
            if sent % 64 == 0:
                time.sleep(0.0002)  # pacing, not measurement: lets softirq drain the backlog
    print(sent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
