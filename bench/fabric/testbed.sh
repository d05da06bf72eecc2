#!/bin/bash
# A leaf–spine fabric out of Linux network namespaces and veth links, for
# testing and benchmarking Stellar across real multipath routing on one box.
#
#   hosts ──► leaf (router) ══ECMP══► spine 1..S ══► leaf ──► hosts
#
# Namespaces (prefix $STB_PREFIX, default "stb-", so teardown removes exactly
# what was created):  <p>leafL, <p>spineS, <p>hL-H (host H on leaf L).
# Addresses:  host L,H      10.L.H.2/24 (gateway 10.L.H.1 on leaf L, dev to-hH)
#             leaf L–spine S  10.(100+S).L.1 (leaf, dev to-sS) / .2 (spine, dev to-lL)
# The veths are created directly inside the namespaces (never in the root
# namespace), so deleting the namespaces deletes every link. Links carry
# jumbo frames (MTU 9000): the soft provider's 4 KiB packets then cross the
# fabric unfragmented, as RoCE does on a fabric with a 4096-byte path MTU.
#
# Segmentation: a host's kernel hands its eth0 send batches (UDP GSO, TCP
# TSO: up to 64 KiB) that a NIC would cut into MTU-sized packets. veth does
# not cut them: a batch left whole crosses the routers as one packet, costing
# one forwarding per batch instead of one per packet, and a loss rule or tbf
# then acts on the whole batch. `--segment` says which protocols the hosts cut
# before the fabric (ethtool on each host's eth0):
#   udp   (default) UDP cut into datagrams, TCP batches whole: loss acts per
#         datagram on Stellar (what the loss and multipath tests rely on),
#         but TCP pays one forwarding per 64 KiB where UDP pays one per 8 KiB
#   all   both cut: the fabric sees single packets of both, as on a wire
#   none  both whole: the fabric's forwarding cost per batch for both, as
#         NICs with segmentation offload (TSO, USO) present it to the host CPU
# Benchmarks comparing Stellar with TCP use `all` or `none` (docs/benchmarks.md).
#
# Usage: bench/fabric/testbed.sh COMMAND [ARGS]
#   up [--spines N(2-4)] [--hosts H] [--leaves L] [--segment udp|all|none]
#                                         build it (tears down a previous one)
#   segment udp|all|none                  where the hosts' send batches are cut into
#                                         packets (below); status shows it
#   down                                  remove every namespace with the prefix
#   status                                namespaces, links, loss and rate settings
#   addr L H                              the address of host H on leaf L
#   exec L H CMD...                       run CMD in host H on leaf L
#   fail-link L S | restore-link L S      take the leaf L–spine S link down/up and
#                                         reprogram the ECMP routes of every leaf
#   set-loss spine S PCT                  drop PCT% (0.1% steps) of packets forwarded by spine S
#   set-loss link L S PCT                 drop PCT% on the leaf L–spine S link, each direction
#   set-rate L H RATE [LIMIT]             tbf on leaf L's downlink to host H (RATE e.g. 1gbit,
#                                         "off" removes; LIMIT = queue bytes, default 256kb)
#   set-link-rate L S RATE [LIMIT]        tbf on both directions of the leaf L–spine S link
#                                         (leaf's uplink and spine's downlink; "off" removes)
#   set-mtu L S MTU                       the leaf L–spine S link's MTU (both ends; 9000 at up):
#                                         a smaller link on the path between jumbo-frame hosts;
#                                         the routers drop larger DF packets (ICMP "fragmentation
#                                         needed" goes back, which the soft provider's sockets ignore)
#   set-mark spine S PCT                  spine S marks PCT% (0.1% steps) of the ECN-capable
#                                         packets it forwards congestion-experienced (CE): a
#                                         switch whose queue is past its ECN threshold (this
#                                         kernel has no RED/CoDel qdisc to mark by queue depth)
#   move-host L H N                       renumber host H on leaf L from its address to 10.L.H.N
#                                         (the new one added, then the old one deleted: what a
#                                         DHCP renumbering or a failed-over interface does)
#   counters                              packets forwarded by each spine (rx of its links)
#   path L1 H1 L2 H2 SPORT DPORT [PROTO]  the spine leaf L1 picks for that flow (udp|tcp)
set -euo pipefail
P=${STB_PREFIX:-stb-}

die() { echo "testbed: $*" >&2; exit 1; }
in_ns() { local ns=$1; shift; ip netns exec "$ns" "$@"; }
leaf() { echo "${P}leaf$1"; }
spine() { echo "${P}spine$1"; }
host() { echo "${P}h$1-$2"; }
# Counts from the namespaces that exist: the topology needs no state file.
count() { ip netns list | awk '{print $1}' | grep -c "^${P}$1" || true; }
leaves() { count leaf; }
spines() { count spine; }
hosts_per_leaf() { ip netns list | awk '{print $1}' | grep -c "^${P}h1-" || true; }
require_up() { (($(leaves) > 0)) || die "no testbed with prefix '$P' (run: testbed.sh up)"; }

new_ns() {
  ip netns add "$1"
  # No IPv6: keeps router solicitations and neighbour discovery out of the
  # packet counters that the tests read.
  in_ns "$1" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  ip -n "$1" link set lo up
}

# veth NS_A DEV_A ADDR_A NS_B DEV_B ADDR_B (addresses /24)
veth() {
  ip link add "$2" netns "$1" mtu 9000 type veth peer name "$5" netns "$4" mtu 9000
  ip -n "$1" addr add "$3/24" dev "$2"
  ip -n "$4" addr add "$6/24" dev "$5"
  ip -n "$1" link set "$2" up
  ip -n "$4" link set "$5" up
}

link_is_up() {  # L S: admin state of the leaf's end (what fail-link changes)
  ip -n "$(leaf "$1")" -o link show "to-s$2" | grep -q '<[^>]*[,<]UP[,>]'
}

# Every leaf's route to every other leaf's hosts: one ECMP nexthop per spine
# whose links to both leaves are up. This is what a routing protocol would
# converge to after a failure; without it a spine whose downlink died would
# keep attracting (and blackholing) the other leaf's traffic.
program_routes() {
  local nl ns l m s hops
  nl=$(leaves); ns=$(spines)
  for ((l = 1; l <= nl; l++)); do
    for ((m = 1; m <= nl; m++)); do
      ((l == m)) && continue
      hops=()
      for ((s = 1; s <= ns; s++)); do
        link_is_up "$l" "$s" && link_is_up "$m" "$s" && hops+=(nexthop via "10.$((100 + s)).$l.2" dev "to-s$s")
      done
      if ((${#hops[@]} == 0)); then
        ip -n "$(leaf "$l")" route replace unreachable "10.$m.0.0/16"
      else
        ip -n "$(leaf "$l")" route replace "10.$m.0.0/16" "${hops[@]}"
      fi
    done
  done
}

cmd_down() {
  local ns pid
  for ns in $(ip netns list | awk '{print $1}' | grep "^${P}" || true); do
    # A process left inside would keep the namespace (and its veths) alive
    # after its name is gone; these are the testbed's own processes.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
}

# segment_host L H MODE: ethtool features of the host's eth0 ("on": the
# device takes batches whole; "off": the kernel cuts them before it).
segment_host() {
  local udp tcp
  case $3 in
    udp) udp=off tcp=on ;;
    all) udp=off tcp=off ;;
    none) udp=on tcp=on ;;
    *) die "segment: udp, all or none, not '$3'" ;;
  esac
  in_ns "$(host "$1" "$2")" ethtool -K eth0 tx-udp-segmentation $udp tcp-segmentation-offload $tcp > /dev/null 2>&1 ||
    die "ethtool -K eth0 failed in host $1.$2"
}

segmentation_of() {  # L H -> udp|all|none, from the host's eth0 features
  local f udp tcp
  f=$(in_ns "$(host "$1" "$2")" ethtool -k eth0)
  udp=$(awk '$1 == "tx-udp-segmentation:" {print $2}' <<< "$f")
  tcp=$(awk '$1 == "tcp-segmentation-offload:" {print $2}' <<< "$f")
  case $udp/$tcp in
    off/on) echo udp ;; off/off) echo all ;; on/on) echo none ;; *) echo "mixed (udp batches $udp, tcp batches $tcp)" ;;
  esac
}

cmd_segment() {
  local mode=${1:?segment: udp, all or none} l h
  require_up
  for ((l = 1; l <= $(leaves); l++)); do
    for ((h = 1; h <= $(hosts_per_leaf); h++)); do segment_host "$l" "$h" "$mode"; done
  done
}

cmd_up() {
  local nl=2 ns=2 nh=4 segment=udp
  while (($#)); do
    case $1 in
      --spines) ns=$2; shift 2 ;;
      --hosts) nh=$2; shift 2 ;;
      --leaves) nl=$2; shift 2 ;;
      --segment) segment=$2; shift 2 ;;
      *) die "up: unknown option $1" ;;
    esac
  done
  ((ns >= 2 && ns <= 4)) || die "--spines must be 2-4"
  ((nh >= 1 && nh <= 16 && nl >= 2 && nl <= 8)) || die "--hosts 1-16, --leaves 2-8"
  [[ $segment =~ ^(udp|all|none)$ ]] || die "--segment must be udp, all or none"
  cmd_down
  local l s h
  for ((s = 1; s <= ns; s++)); do
    new_ns "$(spine "$s")"
    in_ns "$(spine "$s")" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
  done
  for ((l = 1; l <= nl; l++)); do
    new_ns "$(leaf "$l")"
    # ECMP hashes the 5-tuple read from each packet, as a switch does, so UDP
    # flows that differ only in source port can take different spines.
    # Policy 3 with the 5-tuple's fields (source and destination address,
    # protocol, source and destination port: 0x37), not policy 1: policy 1
    # takes a hash the sending kernel already put on the packet when there
    # is one, and across veths in one kernel there is: a connected UDP
    # socket's random sk_txhash. Every connected socket would then pick its
    # spine by that random value, not by its ports (and not as `path`
    # below predicts), which no switch does.
    in_ns "$(leaf "$l")" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.fib_multipath_hash_policy=3 \
      net.ipv4.fib_multipath_hash_fields=0x0037 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
    for ((s = 1; s <= ns; s++)); do
      veth "$(leaf "$l")" "to-s$s" "10.$((100 + s)).$l.1" "$(spine "$s")" "to-l$l" "10.$((100 + s)).$l.2"
      ip -n "$(spine "$s")" route add "10.$l.0.0/16" via "10.$((100 + s)).$l.1"
    done
    for ((h = 1; h <= nh; h++)); do
      new_ns "$(host "$l" "$h")"
      veth "$(host "$l" "$h")" eth0 "10.$l.$h.2" "$(leaf "$l")" "to-h$h" "10.$l.$h.1"
      ip -n "$(host "$l" "$h")" route add default via "10.$l.$h.1"
      segment_host "$l" "$h" "$segment"
    done
  done
  program_routes
  echo "testbed '$P' up: $nl leaves, $ns spines, $nh hosts per leaf, segmentation at the hosts: $segment"
}

cmd_move_host() {
  local l=${1:?leaf} h=${2:?host} n=${3:?new last octet} ns old
  require_up
  ((n >= 3 && n <= 254)) || die "move-host: the new last octet must be 3-254 (.1 is the leaf, .2 the first address)"
  ns=$(host "$l" "$h")
  old=$(ip -n "$ns" -4 -o addr show dev eth0 | awk '{print $4}' | head -1)
  [[ -n $old ]] || die "move-host: host $l.$h has no address"
  # The new address becomes the primary when the old one goes, and the
  # subnet and default routes stay.
  in_ns "$ns" sysctl -qw net.ipv4.conf.eth0.promote_secondaries=1
  # One `ip` process for the three steps: the host is without its default
  # route (which goes with the old primary address) for microseconds, not
  # the milliseconds each extra process would add.
  ip -n "$ns" -batch - << EOF
addr add 10.$l.$h.$n/24 dev eth0
addr del $old dev eth0
route replace default via 10.$l.$h.1
EOF
  echo "host $l.$h moved from ${old%/*} to 10.$l.$h.$n"
}

cmd_status() {
  require_up
  local l m s h
  echo "testbed '$P': $(leaves) leaves, $(spines) spines, $(hosts_per_leaf) hosts per leaf, segmentation at the hosts: $(segmentation_of 1 1)"
  for ((l = 1; l <= $(leaves); l++)); do
    for ((s = 1; s <= $(spines); s++)); do
      printf "  leaf%d-spine%d %s\n" "$l" "$s" "$(link_is_up "$l" "$s" && echo up || echo DOWN)"
    done
    for ((m = 1; m <= $(leaves); m++)); do
      ((l == m)) || ip -n "$(leaf "$l")" route show "10.$m.0.0/16" | sed "s/^/  leaf$l: /"
    done
    for ((h = 1; h <= $(hosts_per_leaf); h++)); do
      tc -n "$(leaf "$l")" qdisc show dev "to-h$h" | grep tbf | sed "s/^/  leaf$l to-h$h: /" || true
    done
  done
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^${P}(leaf|spine)"); do
    in_ns "$ns" nft list table inet stb 2>/dev/null | grep drop | sed "s/^\s*/  $ns: /" || true
  done
}

# Loss rules live in table "inet stb" of the namespace, one chain per rule
# key, so setting a rate again replaces the rule and 0 removes it.
set_drop() {  # NS KEY MATCH PERMILLE
  local ns=$1 key=$2 match=$3 permille=$4
  in_ns "$ns" nft -f - <<EOF
table inet stb {}
EOF
  in_ns "$ns" nft delete chain inet stb "$key" 2>/dev/null || true
  ((permille > 0)) || return 0
  # 100%: a blackhole (numgen's "< 1000" would be out of its range).
  local rule="numgen random mod 1000 < $permille"
  ((permille < 1000)) || rule=""
  in_ns "$ns" nft -f - <<EOF
table inet stb {
  chain $key {
    type filter hook forward priority 0; policy accept;
    $match $rule counter drop
  }
}
EOF
}

# ECN marks, as set_drop's rules: chain "mark_all" in the spine's table.
cmd_set_mark() {
  require_up
  [[ ${1:-} == spine && $# == 3 ]] || die "set-mark spine S PCT"
  local ns permille rule
  ns=$(spine "$2")
  permille=$(permille_of "$3")
  in_ns "$ns" nft -f - <<EOF
table inet stb {}
EOF
  in_ns "$ns" nft delete chain inet stb mark_all 2>/dev/null || true
  ((permille > 0)) || return 0
  rule="numgen random mod 1000 < $permille"
  ((permille < 1000)) || rule=""
  in_ns "$ns" nft -f - <<EOF
table inet stb {
  chain mark_all {
    type filter hook forward priority 0; policy accept;
    ip ecn ect0 $rule ip ecn set ce counter
  }
}
EOF
}

permille_of() {  # "1" -> 10, "0.1" -> 1; refuses finer than 0.1%
  python3 -c "import sys; v=float(sys.argv[1])*10; r=round(v); sys.exit(f'bad loss {sys.argv[1]} (0-100, 0.1 steps)') if abs(v-r)>1e-9 or not 0<=r<=1000 else print(r)" "$1"
}

cmd_set_loss() {
  require_up
  local permille
  case ${1:-} in
    spine)
      (($# == 3)) || die "set-loss spine S PCT"
      permille=$(permille_of "$3")
      set_drop "$(spine "$2")" loss_all "" "$permille" ;;
    link)
      (($# == 4)) || die "set-loss link L S PCT"
      permille=$(permille_of "$4")
      set_drop "$(leaf "$2")" "loss_s$3" "oifname \"to-s$3\"" "$permille"
      set_drop "$(spine "$3")" "loss_l$2" "oifname \"to-l$2\"" "$permille" ;;
    *) die "set-loss spine S PCT | set-loss link L S PCT" ;;
  esac
}

# tbf on NS/DEV, or off: tbf RATE [LIMIT]
set_tbf() {
  if [[ $3 == off ]]; then
    tc -n "$1" qdisc del dev "$2" root 2> /dev/null || true
  else
    tc -n "$1" qdisc replace dev "$2" root handle 1: tbf rate "$3" burst 64kb limit "${4:-256kb}"
  fi
}

cmd_set_link_rate() {
  require_up
  (($# >= 3)) || die "set-link-rate L S RATE [LIMIT]"
  set_tbf "$(leaf "$1")" "to-s$2" "$3" "${4:-256kb}"
  set_tbf "$(spine "$2")" "to-l$1" "$3" "${4:-256kb}"
}

cmd_set_mtu() {
  require_up
  (($# == 3)) || die "set-mtu L S MTU"
  ip -n "$(leaf "$1")" link set dev "to-s$2" mtu "$3"
  ip -n "$(spine "$2")" link set dev "to-l$1" mtu "$3"
}

cmd_set_rate() {
  require_up
  (($# >= 3)) || die "set-rate L H RATE [LIMIT]"
  local ns dev
  ns=$(leaf "$1"); dev="to-h$2"
  if [[ $3 == off ]]; then
    tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  else
    # burst: a few jumbo frames; limit: the switch port's buffer.
    tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$3" burst 64kb limit "${4:-256kb}"
  fi
}

cmd_link() {  # up|down L S
  require_up
  local state=$1 l=$2 s=$3
  ip -n "$(leaf "$l")" link set "to-s$s" "$state"
  ip -n "$(spine "$s")" link set "to-l$l" "$state"
  program_routes
}

cmd_counters() {
  require_up
  local s l sum
  for ((s = 1; s <= $(spines); s++)); do
    sum=0
    for ((l = 1; l <= $(leaves); l++)); do
      sum=$((sum + $(in_ns "$(spine "$s")" cat "/sys/class/net/to-l$l/statistics/rx_packets")))
    done
    echo "spine$s $sum"
  done
}

cmd_path() {  # L1 H1 L2 H2 SPORT DPORT [PROTO] -> spine number
  require_up
  (($# == 6 || $# == 7)) || die "path L1 H1 L2 H2 SPORT DPORT [udp|tcp]"
  local dev
  # The kernel's own multipath lookup for a forwarded packet of that 5-tuple.
  dev=$(ip -n "$(leaf "$1")" route get "10.$3.$4.2" from "10.$1.$2.2" iif "to-h$2" ipproto "${7:-udp}" sport "$5" dport "$6" |
    grep -o 'dev to-s[0-9]*' | head -1)
  [[ -n $dev ]] || die "no route"
  echo "${dev#dev to-s}"
}

command=${1:-}
shift || true
case $command in
  up) cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  segment) cmd_segment "$@" ;;
  addr) echo "10.$1.$2.2" ;;
  exec) l=$1 h=$2; shift 2; in_ns "$(host "$l" "$h")" "$@" ;;
  fail-link) cmd_link down "$@" ;;
  restore-link) cmd_link up "$@" ;;
  set-loss) cmd_set_loss "$@" ;;
  set-rate) cmd_set_rate "$@" ;;
  set-link-rate) cmd_set_link_rate "$@" ;;
  set-mtu) cmd_set_mtu "$@" ;;
  set-mark) cmd_set_mark "$@" ;;
  counters) cmd_counters ;;
  move-host) cmd_move_host "$@" ;;
  path) cmd_path "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
