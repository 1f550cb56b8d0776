#!/bin/bash
# reward 1 when /app/greeting.txt holds exactly "Hi there"
mkdir -p /logs/verifier
if [ "$(cat /app/greeting.txt 2>/dev/null)" = "Hi there" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
