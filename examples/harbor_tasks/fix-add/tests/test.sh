#!/bin/bash
# reward 1 when calc.add sums (and calc.mul still multiplies)
mkdir -p /logs/verifier
cd /app
if python -c "import calc; assert calc.add(2, 3) == 5 and calc.add(-1, 1) == 0 and calc.mul(3, 4) == 12"; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
