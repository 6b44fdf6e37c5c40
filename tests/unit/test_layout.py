"""The repository's layout rules that a newcomer breaks without noticing: planes import each other only through the
exceptions docs/architecture.md lists, and no two test files share a basename (pytest's rootdir-relative module
names collide: the whole suite then stops at collection)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT = re.compile(r"^\s*(?:from|import)\s+(miles\.\w+(?:\.\w+)*)", re.M)
PLANES = ("engine", "trainer", "rollout", "weight_sync", "ft", "run", "spmd", "dashboard")
# (importing plane, imported module prefix): docs/architecture.md's documented exceptions
ALLOWED = {
    ("engine", "miles.weight_sync.disk_delta"), ("engine", "miles.weight_sync.buckets"),
    ("trainer", "miles.weight_sync.p2p"), ("trainer", "miles.weight_sync.buckets"),
    ("trainer", "miles.engine.routed_experts"),
    ("weight_sync", "miles.rollout.client"), ("ft", "miles.rollout"), ("ft", "miles.weight_sync"),
}


def test_planes_import_each_other_only_through_the_documented_exceptions():
    bad = []
    for plane in ("engine", "trainer", "weight_sync"):
        for path in sorted((ROOT / "miles" / plane).rglob("*.py")):
            for mod in IMPORT.findall(path.read_text()):
                other = mod.split(".")[1]
                if other in PLANES and other != plane and not any(
                        p == plane and (mod == m or mod.startswith(m + ".")) for p, m in ALLOWED):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_test_files_have_distinct_basenames():
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py") if "fixtures" not in p.parts)
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]
