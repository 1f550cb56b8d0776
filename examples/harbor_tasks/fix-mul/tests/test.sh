#!/bin/bash
# reward 1 when calc.mul multiplies (and calc.add still sums)
mkdir -p /logs/verifier
cd /app
if python -c "import calc; assert calc.mul(2, 3) == 6 and calc.mul(-2, 5) == -10 and calc.add(3, 4) == 7"; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
