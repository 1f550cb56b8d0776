#!/bin/bash
python - <<'PY'
src = open("calc.py").read()
head, tail = src.split("def mul", 1)
open("calc.py", "w").write(head + "def mul" + tail.replace("a + b", "a * b"))
PY
