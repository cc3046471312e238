"""``tools/demo.py``, the main job shown end to end, run as a user runs it: real daemon and
runtime processes on the tiny generated model. It must leave nothing behind, in the
user's home (the runtime's fingerprint memo went to ~/.cache/kvcache) or anywhere else
outside its own temporary folder, which it removes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from harness.procs import REPO, pythonpath_env


def test_the_demo_is_warm_after_a_restart_and_leaves_nothing_behind(
        tmp_path: Path, tiny_model: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in pythonpath_env().items()
           if k not in ("KVCACHE_DIR", "KVCACHE_ADDRESS", "XDG_CACHE_HOME")}
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "demo.py"), "--model", str(tiny_model),
         "--threads", "1", "--n-ctx", "8192", "--requests", "1", "--max-tokens", "2",
         "--json"],  # (the tiny model's byte-level vocabulary makes the prompt ~7,500 tokens)
        capture_output=True, text=True, timeout=300, env={**env, "HOME": str(home)},
        cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["phase"] for r in rows] == ["first start", "after restart"]
    assert rows[0]["cache_hit_kind"] == "cold"
    assert rows[-1]["cache_hit_kind"] == "partial"  # the system prompt, from the daemon
    assert rows[-1]["cache_tier"] in ("ram", "disk")
    (workdir,) = re.findall(r"starting daemon and runtime in (\S+)", out.stderr)
    assert not Path(workdir).exists()
    assert list(home.iterdir()) == []
    assert sorted(os.listdir(tmp_path)) == ["home"]
