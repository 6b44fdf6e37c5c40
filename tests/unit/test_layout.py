"""The repository's layout rules that a newcomer breaks without noticing: the ground floors (config, utils, types)
import no plane, each plane imports only what the table below (docs/architecture.md's picture) allows, and no two
test files share a basename (pytest's rootdir-relative module names collide: the whole suite then stops at
collection).

Every import counts, lazy ones inside functions and ``TYPE_CHECKING`` ones included: the whole file text is scanned."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MILES = ROOT / "miles"
# `from miles.a.b import x`, `import miles.a.b`, and `from miles import a, b` (-> miles.a, miles.b)
DOTTED = re.compile(r"^\s*(?:from|import)\s+(miles(?:\.\w+)+)", re.M)
FROM_ROOT = re.compile(r"^\s*from\s+miles\s+import\s+(?:\(([^)]*)\)|([\w \t,]+))", re.M)

GROUND = ("config", "utils", "types")           # miles/config/, miles/utils/, miles/types.py
# What each package may import besides itself and the ground floors: module prefixes (a prefix allows its
# submodules). Mirrors docs/architecture.md "Package layout and import direction"; change both together.
ALLOWED: dict[str, tuple[str, ...]] = {
    "config": (), "utils": (), "types": (),     # the ground floors: one another only, never a plane
    "spmd": (),
    "fleet": (),
    "backends": (),                             # Miles's plugin-facing miles.backends.* names (pure helpers)
    "engine": ("miles.weight_sync.disk_delta", "miles.weight_sync.buckets", "miles.weight_sync.hf_layout"),
    "rollout": ("miles.fleet",),
    "weight_sync": ("miles.fleet.client",),
    "trainer": ("miles.weight_sync.p2p", "miles.weight_sync.buckets", "miles.weight_sync.hf_layout",
                "miles.engine.routed_experts"),
    "ft": ("miles.fleet", "miles.weight_sync.base"),
    "dashboard": ("miles.spmd",),               # the type of start()'s context only
    "run": ("miles.spmd", "miles.fleet", "miles.rollout", "miles.trainer", "miles.weight_sync", "miles.ft",
            "miles.dashboard"),             # the run wires every plane; nothing imports it
}
# (importing package, imported prefix) pairs that break the table today only because another branch's pending
# work removes them; each entry must still occur (the test below fails once it is gone: then delete it here).
PENDING: set[tuple[str, str]] = set()


def _package(path: Path) -> str:
    rel = path.relative_to(MILES)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else ""


def _imports(text: str) -> list[str]:
    mods = DOTTED.findall(text)
    for group in FROM_ROOT.findall(text):
        mods += [f"miles.{n.split()[0]}" for n in "".join(group).split(",") if n.strip()]  # `a as b` -> a
    return mods


def _violations() -> tuple[list[str], set[tuple[str, str]]]:
    bad, pending_seen = [], set()
    for path in sorted(MILES.rglob("*.py")):
        pkg = _package(path)
        for mod in _imports(path.read_text()):
            other = mod.split(".")[1]
            if other not in ALLOWED or other == pkg or other in GROUND:
                continue  # not a package (miles.__version__), itself, or a ground floor
            if any(mod == m or mod.startswith(m + ".") for m in ALLOWED.get(pkg, ())):
                continue
            pending = next(((p, m) for p, m in PENDING if p == pkg and (mod == m or mod.startswith(m + "."))), None)
            if pending:
                pending_seen.add(pending)
                continue
            bad.append(f"{path.relative_to(ROOT)} imports {mod} ({pkg} may import the ground floors"
                       f"{', ' + ', '.join(ALLOWED.get(pkg, ())) if ALLOWED.get(pkg) else ''} only)")
    return bad, pending_seen


def test_every_package_has_a_row_in_the_table():
    found = {_package(p) for p in MILES.rglob("*.py")} - {""}
    assert found == set(ALLOWED), f"add to ALLOWED (and docs/architecture.md): {sorted(found - set(ALLOWED))}; " \
                                  f"gone: {sorted(set(ALLOWED) - found)}"


def test_planes_import_only_what_the_table_allows():
    bad, _ = _violations()
    assert not bad, "\n".join(bad)


def test_pending_exceptions_are_still_needed():
    _, seen = _violations()
    assert seen == PENDING, f"no longer imported, remove from PENDING: {sorted(PENDING - seen)}"


def test_the_scan_sees_every_form_of_import():
    text = ("from miles.trainer.lora import x\n"
            "def f():\n    import miles.rollout.data as d\n"
            "if TYPE_CHECKING:\n    from miles import fleet, run as r\n"
            "from miles import (\n    spmd,\n    ft,\n)\n")
    assert _imports(text) == ["miles.trainer.lora", "miles.rollout.data", "miles.fleet", "miles.run", "miles.spmd",
                              "miles.ft"]


def test_test_files_have_distinct_basenames():
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py") if "fixtures" not in p.parts)
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]


def test_megatron_shared_modules_name_no_family():
    """A family has one place (miles/trainer/megatron/families/<name>.py): the shared Megatron modules reach it only
    through the registry (``families.family_of`` / ``ModelShape.family``), never by importing a family's module."""
    megatron = MILES / "trainer" / "megatron"
    family_module = re.compile(r"miles\.trainer\.megatron\.families\.\w+|from\s+miles\.trainer\.megatron\.families\s+"
                               r"import\s+[^\n]*\b(?:" + "|".join(
                                   p.stem for p in (megatron / "families").glob("*.py") if p.stem != "__init__") +
                               r")\b")
    bad = [str(p.relative_to(ROOT)) for p in sorted(megatron.rglob("*.py"))
           if "families" not in p.parts and family_module.search(p.read_text())]
    assert not bad, f"these shared modules import a family's module (use the registry's hooks instead): {bad}"
