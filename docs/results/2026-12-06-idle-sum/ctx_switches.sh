#!/bin/bash
# throwaway: per-thread context switches over 10 s of an envoy pid
P=$1
snap() { for t in /proc/$P/task/*; do echo "${t##*/} $(cat $t/comm) $(grep -E '^(voluntary|nonvoluntary)_ctxt' $t/status | awk '{print $2}' | tr '\n' ' ')"; done; }
snap > /tmp/ctx_a; sleep 10; snap > /tmp/ctx_b
join /tmp/ctx_a /tmp/ctx_b | awk '{v=($6-$3)/10; n=($7-$4)/10; if (v+n>0) printf "%s %s vol/s %.1f invol/s %.1f\n", $1, $2, v, n}'
