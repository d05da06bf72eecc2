#!/usr/bin/env python3
"""roce_icrc_check.py IFACE COUNT: captures COUNT RoCEv2 datagrams (UDP port
4791) on IFACE with an AF_PACKET socket, as a switch port would see them, and
checks every one's ICRC against the bytes actually on the wire: the IPv4
header with TOS, TTL and checksum forced to ones, the UDP checksum forced to
ones, the BTH's reserved byte forced to ones, behind 8 bytes of ones (IBTA
Annex A17.3.3), CRC-32 stored little-endian. Run where the datagrams have
been segmented (the testbed's hosts segment UDP GSO at their veth), so that
each one carries the IP id the kernel gave it. Prints the counts and the IP
ids seen; exits 1 if any ICRC is wrong or fewer than COUNT arrive in 20 s."""
import select
import socket
import struct
import sys
import time
import zlib

iface, wanted = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
s.bind((iface, 0))
print("capturing", flush=True)  # the test starts the traffic once this is out
good = bad = 0
ids = set()
deadline = time.time() + 20
while good + bad < wanted and time.time() < deadline:
    if not select.select([s], [], [], 0.5)[0]:
        continue
    frame = s.recv(65536)
    ip = frame[14:]
    if len(ip) < 20 or ip[9] != 17:
        continue
    ihl = (ip[0] & 15) * 4
    total = struct.unpack("!H", ip[2:4])[0]
    udp = ip[ihl:total]
    if len(udp) < 8 + 12 + 4 or struct.unpack("!H", udp[2:4])[0] != 4791:
        continue
    pseudo_ip = bytearray(ip[:ihl])
    pseudo_ip[1] = 0xFF
    pseudo_ip[8] = 0xFF
    pseudo_ip[10:12] = b"\xff\xff"
    pseudo_udp = bytearray(udp[:8])
    pseudo_udp[6:8] = b"\xff\xff"
    bth = bytearray(udp[8:20])
    bth[4] = 0xFF
    covered = b"\xff" * 8 + bytes(pseudo_ip) + bytes(pseudo_udp) + bytes(bth) + udp[20:-4]
    icrc = struct.unpack("<I", udp[-4:])[0]
    ids.add(struct.unpack("!H", ip[4:6])[0])
    if zlib.crc32(covered) & 0xFFFFFFFF == icrc:
        good += 1
    else:
        bad += 1
print(f"{iface}: {good} RoCEv2 datagrams with a correct ICRC, {bad} wrong; IP ids seen: {sorted(ids)[:16]}{' ...' if len(ids) > 16 else ''}")
sys.exit(0 if bad == 0 and good >= wanted else 1)
