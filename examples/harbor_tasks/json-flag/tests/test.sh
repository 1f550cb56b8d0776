#!/bin/bash
# reward.json: valid_json and debug_on as components, reward 1 when the file is right and nothing else changed
mkdir -p /logs/verifier
python - <<'PY'
import json
out = {"valid_json": 0.0, "debug_on": 0.0, "reward": 0.0}
try:
    cfg = json.load(open("/app/config.json"))
    out["valid_json"] = 1.0
    out["debug_on"] = float(cfg.get("debug") is True)
    out["reward"] = float(cfg == {"name": "demo", "debug": True, "port": 8080})
except Exception:
    pass
json.dump(out, open("/logs/verifier/reward.json", "w"))
PY
