#!/bin/bash
# reward 1 when count.txt holds the number of lines of data/items.txt
mkdir -p /logs/verifier
want=$(wc -l < /app/data/items.txt)
got=$(tr -d '[:space:]' < /app/count.txt 2>/dev/null)
if [ "$got" = "$want" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
