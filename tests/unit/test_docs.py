"""The docs stand alone: every path they cite exists in this repository, every cited test exists, no
file of the repository points at notes or folders outside it (``notes/...``, ``/work/...``, a ``../``
that leaves the checkout), and a Miles upstream file is named ``radixark/miles@v0.1.0:<path>``, never as a
``miles/...`` path that reads as one of ours."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Paths a doc names on purpose although they do not exist yet (a design for later), with where and why.
PLANNED = {
    "miles/weight_sync/p2p.py": "docs/weight-sync.md: the proposed P2P RDMA mode, not built",
}

_LINK = re.compile(r"\]\(([^)\s]+)\)")                          # [text](target)
_CODE = re.compile(r"`([^`\s]+)`")                              # `path/inside/the/repo.py`
_NODE = re.compile(r"([\w./-]+\.py)::(\w+)")                    # tests/x.py::test_name
_OUTSIDE = re.compile(r"(?<![\w.-])notes/|shared/notes|/work/|/tmp/team")
_PARENT = re.compile(r"(?<![\w./$-])((?:\.\./)+[\w./-]*)")
_MILES_PATH = re.compile(r"(?<![\w./-])(miles/[\w/.-]*?\.py)\b")   # miles/x/y.py, not foo/miles/x.py
UPSTREAM = "radixark/miles@v0.1.0:"                             # how a Miles upstream file is named


def _repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [f for f in out.stdout.splitlines() if (REPO / f).is_file()]


def _docs() -> list[str]:
    return sorted(f for f in _repo_files() if f.endswith(".md"))


def _text_files() -> list[str]:
    suffixes = (".md", ".py", ".sh", ".txt", ".toml", ".cfg", ".yaml", ".yml", ".json")
    me = str(Path(__file__).resolve().relative_to(REPO))
    return sorted(f for f in _repo_files() if (f.endswith(suffixes) or "/" not in f and f == "Makefile") and f != me)


def _top_level() -> set[str]:
    return {f.split("/")[0] for f in _repo_files() if "/" in f}


def _lines(f: str) -> list[tuple[int, str]]:
    return list(enumerate((REPO / f).read_text(errors="replace").splitlines(), 1))


def test_markdown_links_resolve_inside_the_repo():
    bad = []
    for f in _docs():
        for i, line in _lines(f):
            for m in _LINK.finditer(line):
                target = m.group(1).split("#")[0]
                if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, http:, mailto:
                    continue
                path = ((REPO / f).parent / target).resolve()
                if not path.is_relative_to(REPO) or not path.exists():
                    bad.append(f"{f}:{i}: link to {target!r}, which is not a path in this repository")
    assert not bad, "\n".join(bad)


def test_cited_repo_paths_exist():
    top, bad = _top_level(), []
    for f in _docs():
        for i, line in _lines(f):
            for m in _CODE.finditer(line):
                path = m.group(1).split("::")[0].rstrip(",.;:")
                if "/" not in path or path.split("/")[0] not in top or re.search(r"[*<>{}\[\]$]", path):
                    continue  # not a repo path (a flag, a URL path, a pattern like outputs/<run>/)
                if path.rstrip("/") in PLANNED:
                    continue
                if not (REPO / path).exists():
                    bad.append(f"{f}:{i}: `{m.group(1)}` does not exist in this repository")
    assert not bad, "\n".join(bad)


def test_cited_tests_exist():
    bad = []
    for f in _docs():
        for i, line in _lines(f):
            for m in _NODE.finditer(line):
                path, name = REPO / m.group(1), m.group(2)
                if not path.is_file():
                    bad.append(f"{f}:{i}: {m.group(0)}: no file {m.group(1)}")
                elif not re.search(rf"^(?:async )?def {name}\(|^class {name}\b", path.read_text(), re.M):
                    bad.append(f"{f}:{i}: {m.group(0)}: no test {name} in {m.group(1)}")
    assert not bad, "\n".join(bad)


def test_nothing_points_outside_the_repo():
    bad = []
    for f in _text_files():
        for i, line in _lines(f):
            if _OUTSIDE.search(line):
                bad.append(f"{f}:{i}: {line.strip()[:120]}")
            for m in _PARENT.finditer(line):
                if not ((REPO / f).parent / m.group(1)).resolve().is_relative_to(REPO):
                    bad.append(f"{f}:{i}: {m.group(1)!r} leaves the repository")
    assert not bad, "outside references (put the figure or fact in docs/ and cite that):\n" + "\n".join(bad)


def _foreign_miles_paths(text: str) -> list[str]:
    """``miles/...py`` paths in ``text`` that are not files of this repository and not named as Miles's."""
    return [m.group(1) for m in _MILES_PATH.finditer(text)
            if not text[:m.start()].endswith(UPSTREAM) and not (REPO / m.group(1)).is_file()]


def test_miles_upstream_files_are_named_as_upstream():
    """A ``miles/...py`` path in any file (comment, docstring, doc) is one of ours, or is written
    ``radixark/miles@v0.1.0:miles/...py``: a bare ``miles/utils/arguments.py`` reads as a file of this repository."""
    bad = []
    for f in _text_files():
        text = (REPO / f).read_text(errors="replace")
        for path in _foreign_miles_paths(text):
            bad.append(f"{f}: {path} is not a file here; name Miles's as {UPSTREAM}{path}, or fix the path")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path: Path):
    """The patterns above match the cases they exist for (so a green run means something)."""
    assert _OUTSIDE.search("see notes/anchors.md") and _OUTSIDE.search("(/work/shared/notes/x.md)")
    assert not _OUTSIDE.search("release-notes/x") and not _OUTSIDE.search("footnotes/")
    assert _LINK.findall("[a](docs/x.md#y) and [b](https://e.com)") == ["docs/x.md#y", "https://e.com"]
    assert _NODE.findall("`tests/e2e/test_x.py::test_y`") == [("tests/e2e/test_x.py", "test_y")]
    assert _PARENT.findall('REPO="$(cd "$HERE/../.." && pwd)"') == []  # $HERE/..: relative to a variable
    assert _PARENT.findall("see ../../notes/x.md") == ["../../notes/x.md"]
    assert _foreign_miles_paths("# as Miles's miles/utils/arguments.py does") == ["miles/utils/arguments.py"]
    assert _foreign_miles_paths("(``miles/backends/fsdp_utils/arguments.py``)") == ["miles/backends/fsdp_utils/arguments.py"]
    assert _foreign_miles_paths(f"# {UPSTREAM}miles/utils/arguments.py, miles/run/loop.py") == []
    assert _foreign_miles_paths("tools/miles/x.py and miles.utils.arguments") == []


def test_family_table_names_tests_that_exist():
    """docs/trainer.md's "Families x backends x parallelism" table: every ``tests/...py::test_name`` (or test file) a
    cell names exists, so a renamed or removed test fails here; every row has one cell per column."""
    import re

    text = (REPO / "docs" / "trainer.md").read_text()
    section = text[text.index("### Families x backends x parallelism"):]
    rows = [ln for ln in section.split("\n\n", 3)[2].splitlines() if ln.startswith("|")]
    assert len(rows) >= 3 and rows[1].startswith("|---"), rows[:2]
    columns = rows[0].count(" | ") + 1
    named = 0
    for row in rows[2:]:
        assert row.count(" | ") + 1 == columns, row[:80]
        for path, name in re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", row):
            assert (REPO / path).is_file(), (path, row[:60])
            if name:
                assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), (path, name)
            named += 1
    assert named >= 20, named
