"""Run Miles's own fast tests of the modules its plugins import, and import its example plugins, against THIS package.

    python tools/miles_fast_tests.py --mirror MILES_GIT_DIR --rev v0.1.0      # a Miles git repository (bare is fine)
    python tools/miles_fast_tests.py --miles-dir ~/src/miles            # a Miles checkout
    python tools/miles_fast_tests.py --mirror DIR --only rm_hub --only test_types   # some files
    python tools/miles_fast_tests.py --mirror DIR --no-examples --keep               # keep the temp dir

Miles's files (``tests/`` support packages, the test files below, ``examples/``) are copied with ``git archive``
(or from the checkout) into a temporary directory OUTSIDE this repository; nothing of Miles enters the repository.
That directory gets its own ``pytest.ini`` and a minimal ``tests/conftest.py`` written here in place of Miles's
(radixark/miles@v0.1.0:tests/conftest.py imports its rollout/generation fixtures, which need Miles's session server
and mock SGLang server, and defines the Ray fixture ``ray_local_mode``): it keeps Miles's autouse fixture that clears
``MILES_USE_LEGACY_ROLLOUT_V1`` and runs ``async def`` tests on a fresh event loop (Miles's ``asyncio_mode = "auto"``)
when pytest-asyncio is not installed. ``PYTHONPATH`` is that directory, then this checkout: ``import miles`` is ours.
Each test file runs in its own pytest process (``--timeout`` seconds each), with ``HF_HUB_OFFLINE=1`` unless
``--online``: a test that fails only because a tokenizer named by its hub id is not in the local cache counts under
``needs_hub``, not ``failed``.

The table per file: collected, import errors (the file, or a conftest.py of its folder, did not import; with every
``miles`` name the file and the ``tests.*`` modules it imports use that this package lacks), passed, failed, errors
(a fixture or setup failed), skipped, needs_hub. ``--also FILE`` runs further Miles test files.

Then the examples: every ``examples/**.py`` module of Miles imported in a child process (``examples.a.b`` as Miles
imports them from its repository root, or by name from its own folder where a folder name has a dash), classed as
``ok``, ``needs PACKAGE`` (a package outside miles; for those, ``miles.rollout.plugins.load_function`` must refuse the
module in one line naming the package), ``own code`` (its own top-level code raised: a script reading argv or an
environment variable), ``MISSING`` (a ``miles`` module or name this package lacks, imported at the top or inside a
function) or ``ERROR`` (raised elsewhere, e.g. in this package). Each also lists what it uses of Miles's ``Sample``
(attributes read on a name ``sample`` / ``*_sample``, ``Sample(...)`` keywords) that this package's lacks, from
Miles's miles/utils/types.py read as text. Exit status 0 unless ``--strict`` (then 1 when a test file did not import,
a test failed, or an example is MISSING / ERROR / refused in more than one line).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

OURS = Path(__file__).resolve().parents[1]

# Miles's fast tests of the modules its plugins import (docs/data-and-rewards.md, "Miles's plugin API").
TEST_DIRS = ("tests/fast/rollout/rm_hub", "tests/fast/rollout/generate_hub")
TEST_FILES = tuple(f"tests/fast/utils/test_{m}.py" for m in
                   ("types", "http_utils", "misc", "async_utils", "mask_utils", "file_arg_utils")) + (
    "tests/fast/rollout/test_on_policy_distillation.py",)
# what the test files import from Miles's tests/ package (package markers, tests.ci.ci_register, the fixtures)
SUPPORT = ("tests/__init__.py", "tests/fast/__init__.py", "tests/fast/rollout/__init__.py",
           "tests/fast/utils/__init__.py", "tests/fast/fixtures", "tests/ci/__init__.py", "tests/ci/ci_register.py",
           "tests/ci/labels.py", *TEST_DIRS, "examples")

CONFTEST = '''"""Written by miles's tools/miles_fast_tests.py in place of radixark/miles@v0.1.0:tests/conftest.py: no Ray.

Left out: ``ray_local_mode`` (Ray), and the ``rollout_env`` / ``generation_env`` fixtures, which Miles's
conftest re-exports from tests/fast/fixtures (the test files that use them import that module themselves).
"""
import asyncio
import inspect

import pytest

try:
    import pytest_asyncio  # noqa: F401
    HAVE_PYTEST_ASYNCIO = True
except ImportError:
    HAVE_PYTEST_ASYNCIO = False


@pytest.fixture(autouse=True)
def clear_legacy_rollout_gate(monkeypatch):
    monkeypatch.delenv("MILES_USE_LEGACY_ROLLOUT_V1", raising=False)


def pytest_configure(config):
    if not HAVE_PYTEST_ASYNCIO:  # Miles's tests mark some async tests with pytest.mark.asyncio (--strict-markers)
        config.addinivalue_line("markers", "asyncio: run on an event loop (pytest-asyncio's marker)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Miles's asyncio_mode = "auto" without pytest-asyncio: an async test runs on a fresh event loop."""
    if HAVE_PYTEST_ASYNCIO or not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    asyncio.run(pyfuncitem.obj(**{n: pyfuncitem.funcargs[n] for n in names}))
    return True
'''
PYTEST_INI = "[pytest]\naddopts = --strict-markers\n" + (
    "asyncio_mode = auto\n" if importlib.util.find_spec("pytest_asyncio") else "")
# a failure that only says the Hugging Face hub could not be reached (a tokenizer by hub name, HF_HUB_OFFLINE=1)
HUB_SIGNS = ("LocalEntryNotFoundError", "outgoing traffic has been disabled", "couldn't connect to 'https://huggingface.co'")


# what the examples and the test files import from miles: checked statically as well (also imports inside functions)
MILES_NAMES = r'''
import ast, importlib, importlib.util
from pathlib import Path


def miles_names(file):
    """The ``miles`` modules and names the file imports anywhere (also inside functions) that this package lacks."""
    missing = []
    for node in ast.walk(ast.parse(Path(file).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "miles":
            wanted = [(node.module, a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names if a.name.split(".")[0] == "miles"]
        else:
            continue
        for module, name in wanted:
            try:
                m = importlib.import_module(module)
            except Exception:
                missing.append(module)
                continue
            if name and not hasattr(m, name):
                try:
                    found = importlib.util.find_spec(f"{module}.{name}") is not None
                except Exception:  # module is not a package
                    found = False
                if not found:
                    missing.append(f"{module}.{name}")
    return sorted(set(missing))


def miles_sample_names(miles_types):
    """The attributes of Miles's ``Sample`` (fields, methods, properties, nested classes) from its source file."""
    tree = ast.parse(Path(miles_types).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Sample")
    names = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(n.name)
    return names


def sample_reads(file, miles_types):
    """Attributes of Miles's ``Sample`` the file reads (on a name ``sample`` or ``*_sample``), and keywords of
    ``Sample(...)`` calls, that this package's Sample lacks."""
    from miles.utils.types import Sample

    import inspect

    probe, theirs = Sample(), miles_sample_names(miles_types)
    tree = ast.parse(Path(file).read_text())
    reads = {node.attr for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
             and (node.value.id == "sample" or node.value.id.endswith("_sample"))}
    accepted = set(inspect.signature(Sample).parameters)
    kwargs = {f"Sample({k.arg}=)" for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Sample"
              for k in node.keywords if k.arg and k.arg in theirs and k.arg not in accepted}
    return sorted({a for a in reads & theirs if not hasattr(probe, a)} | kwargs)
'''


MILES_TYPES = ".miles_utils_types.py"  # Miles's miles/utils/types.py, read (never imported) for its Sample's names


def with_packages(paths: list[str]) -> list[str]:
    """``paths`` and the ``__init__.py`` / ``conftest.py`` of every folder above them up to ``tests/`` (for --also)."""
    out = list(paths)
    for rel in paths:
        parent = Path(rel).parent
        while parent.parts and parent.parts[0] == "tests" and len(parent.parts) > 1:
            out += [str(parent / "__init__.py"), str(parent / "conftest.py")]
            parent = parent.parent
    return sorted(set(out))


def extract(args: argparse.Namespace, dest: Path) -> str:
    """Copy Miles's needed paths into ``dest``; return what was copied from (rev and commit, or the checkout)."""
    wanted = [*TEST_FILES, *with_packages(args.also)]
    if args.miles_dir:
        src = Path(args.miles_dir).resolve()
        for rel in SUPPORT:
            p = src / rel
            if p.is_dir():
                shutil.copytree(p, dest / rel, dirs_exist_ok=True)
            elif p.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dest / rel)
        for rel in wanted:
            if (src / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / rel, dest / rel)
        shutil.copy2(src / "miles" / "utils" / "types.py", dest / MILES_TYPES)
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
        return f"{src} ({head.stdout.strip() or 'not a git checkout'})"
    git = ["git", "-C", args.mirror]
    commit = subprocess.run([*git, "rev-parse", f"{args.rev}^{{commit}}"], capture_output=True, text=True)
    if commit.returncode:
        sys.exit(f"--rev {args.rev!r} is not a revision of --mirror {args.mirror}: {commit.stderr.strip()}")
    names = subprocess.run([*git, "ls-tree", "--name-only", args.rev, *SUPPORT, *wanted],
                           capture_output=True, text=True, check=True).stdout.split()
    archive = subprocess.run([*git, "archive", "--format=tar", args.rev, *names], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    (dest / MILES_TYPES).write_bytes(subprocess.run([*git, "show", f"{args.rev}:miles/utils/types.py"],
                                                    capture_output=True, check=True).stdout)
    return f"{args.mirror} {args.rev} ({commit.stdout.strip()})"


ONLINE = False  # --online: let tests fetch tokenizers from the Hugging Face hub


def our_commit() -> str:
    """This checkout's commit, and whether its working tree differs from it."""
    head = subprocess.run(["git", "-C", str(OURS), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(OURS), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return (head.stdout.strip() or "not a git checkout") + (" + uncommitted changes" if dirty.stdout.strip() else "")


def machine() -> str:
    """Date, machine and the versions the run depends on, for the record."""
    import datetime
    import platform

    versions = subprocess.run([sys.executable, "-c", "import pytest, torch, transformers; print(f'pytest "
                               "{pytest.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"],
                              capture_output=True, text=True).stdout.strip()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"run:   {when}; {platform.machine()} {platform.system()} {platform.release()}, {os.cpu_count()} CPUs; "
            f"Python {platform.python_version()}, {versions}")


def env_for(root: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{OURS}",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONDONTWRITEBYTECODE="1")
    if not ONLINE:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("MILES_USE_LEGACY_ROLLOUT_V1", None)
    return env


def run_test_file(root: Path, rel: str, timeout: int, verbose: bool) -> dict:
    """Run one test file under pytest; count its outcomes from the JUnit XML."""
    xml = root / ".junit" / (rel.replace("/", "_") + ".xml")
    xml.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-c", str(root / "pytest.ini"), "--rootdir", str(root),
           "-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={xml}", rel]
    row = {"file": rel, "collected": 0, "import_errors": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
           "needs_hub": 0, "problems": []}
    try:
        proc = subprocess.run(cmd, cwd=root, env=env_for(root), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        row["problems"].append(f"timed out after {timeout} s")
        return row
    if verbose:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    if not xml.exists():  # e.g. a conftest.py of its folder did not import: counted as the file's import error
        lines = (proc.stdout + proc.stderr).splitlines()
        why = [ln[1:].strip() for ln in lines if ln.startswith("E ")][-1:] or [proc.stderr.strip()[-300:]]
        row["import_errors"] = 1
        row["problems"].append(f"pytest exited {proc.returncode} without a report: {why[0]}")
        return row
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "error" in kinds and "collection failure" in (kinds["error"].get("message") or ""):
            row["import_errors"] += 1
            also = lacking(root, rel)
            also_text = f"; it and the tests.* modules it imports also use, absent here: {', '.join(also)}" if also else ""
            row["problems"].append(f"import: {_first_error_line(kinds['error'])}{also_text}")
            continue
        row["collected"] += 1
        if "skipped" in kinds:
            row["skipped"] += 1
            row["problems"].append(f"skipped {name}: {(kinds['skipped'].get('message') or '')[:200]}")
        elif "failure" in kinds or "error" in kinds:
            node = kinds.get("failure", kinds.get("error"))
            hub = any(sign in (node.text or "") + (node.get("message") or "") for sign in HUB_SIGNS)
            key = "needs_hub" if hub else "failed" if "failure" in kinds else "errors"
            row[key] += 1
            row["problems"].append(f"{key} {name}: {_first_error_line(node)}")
        else:
            row["passed"] += 1
    return row


NAMES_CHILD = MILES_NAMES + r'''
import json, sys
print(json.dumps({f: miles_names(f) for f in sys.argv[1:]}))
'''


def lacking(root: Path, rel: str) -> list[str]:
    """The ``miles`` modules and names a test file, and the ``tests.*`` modules it imports, use that we lack."""
    files = [root / rel]
    for line in (root / rel).read_text().splitlines():
        words = line.split()
        if len(words) > 1 and words[0] in ("from", "import") and words[1].startswith("tests."):
            f = root / (words[1].replace(".", "/") + ".py")
            if f.exists() and f not in files:
                files.append(f)
    proc = subprocess.run([sys.executable, "-c", NAMES_CHILD, *map(str, files)], cwd=root, env=env_for(root),
                          capture_output=True, text=True, timeout=120)
    if proc.returncode:
        return [f"(could not read its imports: {proc.stderr.strip().splitlines()[-1:]})"]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return sorted({name for names in found.values() for name in names})


def _first_error_line(node: ET.Element) -> str:
    """The line of a JUnit failure/error that says what went wrong (pytest's ``E   ...`` lines), else its message."""
    text = (node.text or "").splitlines()
    lines = [ln[1:].strip() for ln in text if ln.startswith("E ")]
    picked = next((ln for ln in lines if "Error" in ln or "assert" in ln), lines[0] if lines else "")
    last = next((ln.strip() for ln in reversed(text) if ln.strip()), "")
    return (picked or last or node.get("message") or "").strip()[:300]


# ---------------------------------------------------------------------------------------------- examples


IMPORT_CHILD = r'''
import ast, importlib, importlib.util, json, sys, traceback
from pathlib import Path
root, out, miles_types = sys.argv[1], sys.argv[2], sys.argv[3]
from miles.config.base import ConfigError
from miles.rollout.plugins import load_function
base_path = list(sys.path)
''' + MILES_NAMES + r'''

# the top-level names an example can be imported under (examples reuse names: run, rollout, agent): forgotten after
# each module, with everything under them, so the next module imports its own
local_tops = {"examples"} | {p.stem for p in Path(root, "examples").rglob("*.py")} | {
    p.name for p in Path(root, "examples").rglob("*") if p.is_dir()}
with open(out, "a") as f:
    for line in sys.stdin:
        idx, mod, path_entry, file = json.loads(line)
        sys.path[:] = [path_entry, root, *base_path]
        f.write(json.dumps({"idx": idx, "started": True}) + "\n"); f.flush()
        rec = {"idx": idx, "module": mod}
        try:
            importlib.import_module(mod)
            rec["outcome"] = "ok"
        except ModuleNotFoundError as e:
            rec["outcome"], rec["name"], rec["message"] = "notfound", e.name or "", str(e)
            try:
                load_function(mod + ".generate", "--custom-generate-function-path")
                rec["refusal"] = "(load_function did not refuse)"
            except ConfigError as c:
                rec["refusal"] = str(c)
            except BaseException as c:
                rec["refusal"] = "(not a ConfigError) " + type(c).__name__ + ": " + str(c)
        except BaseException as e:
            tb = traceback.extract_tb(e.__traceback__)
            rec["outcome"], rec["name"] = "error", getattr(e, "name", "") or ""
            rec["message"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            rec["where"] = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else ""
            own = [fr for fr in tb if fr.filename.startswith(root)]
            rec["own"] = f"{own[-1].filename}:{own[-1].lineno}" if own else ""
        try:
            rec["miles_missing"] = miles_names(file)
        except Exception as e:
            rec["miles_missing"] = [f"(could not read its imports: {type(e).__name__}: {e})"]
        try:
            rec["sample_missing"] = sample_reads(file, miles_types)
        except Exception as e:
            rec["sample_missing"] = [f"(could not read it: {type(e).__name__}: {e})"]
        for name in [n for n in sys.modules if n.split(".")[0] in local_tops]:
            del sys.modules[name]
        f.write(json.dumps(rec) + "\n"); f.flush()
'''


def example_modules(root: Path) -> list[tuple[str, str, str]]:
    """(file, module name, sys.path entry) of each ``examples/**.py``: ``examples.a.b`` as Miles imports them (from
    its repository root) where every folder name is an identifier, else its name from its own folder (``tau-bench``)."""
    mods = []
    for py in sorted((root / "examples").rglob("*.py")):
        parts = list(py.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if all(p.isidentifier() for p in parts):
            mods.append((str(py.relative_to(root)), ".".join(parts), str(py.parent)))
        elif py.stem != "__init__" and py.stem.isidentifier():
            mods.append((str(py.relative_to(root)), py.stem, str(py.parent)))
    return mods


def run_examples(root: Path, timeout: int) -> list[dict]:
    """Import every example module in one child process; a module that hangs is recorded and the rest go on."""
    mods = example_modules(root)
    results: dict[int, dict] = {}
    out = root / ".examples.jsonl"
    while len(results) < len(mods):
        todo = [i for i in range(len(mods)) if i not in results]
        out.write_text("")
        try:
            subprocess.run([sys.executable, "-c", IMPORT_CHILD, str(root), str(out), str(root / MILES_TYPES)], cwd=root, env=env_for(root),
                           input="".join(json.dumps([i, *mods[i][1:], str(root / mods[i][0])]) + "\n" for i in todo), text=True,
                           timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pass
        recs = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
        results.update({r["idx"]: r for r in recs if not r.get("started")})
        started = [r["idx"] for r in recs if r.get("started")]
        stuck = started[-1] if started and started[-1] not in results else None if started else todo[0]
        if stuck is not None:  # it hung, or ended the interpreter, on this one
            results[stuck] = {"idx": stuck, "module": mods[stuck][1], "outcome": "error",
                              "message": f"no result within {timeout} s (hung, or ended the interpreter)"}
    return [classify(dict(results[i], file=mods[i][0]), root) for i in range(len(mods))]


def classify(rec: dict, root: Path) -> dict:
    """ok; needs PKG (a package outside miles; refused in one line?); MISSING (a miles module or name this package
    lacks, imported at the top or inside a function); own code (the example's own top-level code raised: a script
    reading argv or an env var); ERROR (raised elsewhere, e.g. in this package)."""
    name, msg = rec.get("name", ""), rec.get("message", "")
    if rec.get("miles_missing"):
        rec["class"] = "MISSING"
        rec["message"] = f"this package lacks {', '.join(rec['miles_missing'])}; {msg}".rstrip("; ")
    elif rec["outcome"] == "ok":
        rec["class"] = "ok"
    elif rec["outcome"] == "notfound" and name.split(".")[0] not in ("miles", "examples"):
        refusal = rec.get("refusal", "")
        one_line = "\n" not in refusal and f"No module named '{name}'" in refusal
        rec["class"] = f"needs {name.split('.')[0]}" + ("" if one_line else " (NOT refused in one line)")
    elif name.startswith("miles") or "from 'miles" in msg:
        rec["class"] = "MISSING"
    elif rec.get("own") and not rec.get("where", "").startswith(str(OURS / "miles")):
        rec["class"] = "own code"
        rec["message"] += f" (at {rec['own'][len(str(root)) + 1:]})"
    else:
        rec["class"] = "ERROR"
        rec["message"] += f" (at {rec['where']})" if rec.get("where") else ""
    return rec


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--miles-dir", help="a Miles checkout (its working tree)")
    src.add_argument("--mirror", help="a Miles git repository (bare is fine); with --rev")
    p.add_argument("--rev", default="v0.1.0", help="the Miles revision to take from --mirror (default v0.1.0)")
    p.add_argument("--also", action="append", default=[], metavar="TEST_FILE",
                   help="also run this Miles test file (path in Miles's repository); its folders' conftest.py come too")
    p.add_argument("--only", action="append", default=[], help="run only test files whose path contains this")
    p.add_argument("--no-examples", action="store_true", help="skip the examples import check")
    p.add_argument("--no-tests", action="store_true", help="only the examples import check")
    p.add_argument("--timeout", type=int, default=60, help="seconds per pytest run and per examples child")
    p.add_argument("--online", action="store_true",
                   help="do not set HF_HUB_OFFLINE=1 (tests that load tokenizers by hub name may download them)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    p.add_argument("--verbose", action="store_true", help="print each pytest run's output")
    p.add_argument("--strict", action="store_true", help="exit 1 on a failure, error, MISSING or ERROR")
    a = p.parse_args(argv)
    global ONLINE
    ONLINE = a.online
    root = Path(tempfile.mkdtemp(prefix="miles-fast-tests-"))
    if root.resolve().is_relative_to(OURS):
        sys.exit(f"the temporary directory {root} is inside this repository; set TMPDIR elsewhere")
    bad = False
    try:
        origin = extract(a, root)
        (root / "tests" / "conftest.py").write_text(CONFTEST)
        (root / "pytest.ini").write_text(PYTEST_INI)
        print(f"Miles: {origin}\nours:  {OURS} ({our_commit()})\n{machine()}\ncopied to: {root}\n")
        if not a.no_tests:
            files = sorted({str(f.relative_to(root)) for d in TEST_DIRS for f in (root / d).glob("test_*.py")}
                           | {f for f in (*TEST_FILES, *a.also) if (root / f).exists()})
            files = [f for f in files if not a.only or any(o in f for o in a.only)]
            rows = [run_test_file(root, f, a.timeout, a.verbose) for f in files]
            cols = ("collected", "import_errors", "passed", "failed", "errors", "skipped", "needs_hub")
            width = max(len(r["file"]) for r in rows) if rows else 10
            print(f"{'file':<{width}}  " + "  ".join(f"{c:>13}" for c in cols))
            for r in rows:
                print(f"{r['file']:<{width}}  " + "  ".join(f"{r[c]:>13}" for c in cols))
            print(f"{'total':<{width}}  " + "  ".join(f"{sum(r[c] for r in rows):>13}" for c in cols))
            for r in rows:  # one line per distinct reason, with how many tests it covers and the first of them
                seen: dict[str, list[str]] = {}
                for prob in r["problems"]:
                    kind, _, rest = prob.partition(" ")
                    if kind in ("failed", "errors", "needs_hub", "skipped"):
                        test, _, why = rest.partition(": ")
                        seen.setdefault(f"{kind}: {why}", []).append(test.rpartition("::")[2])
                    else:  # import errors and runs without a report: as they are
                        seen.setdefault(prob, []).append("")
                for why, tests in seen.items():
                    first = f" ({len(tests)} tests, e.g. {tests[0]})" if tests[0] else ""
                    print(f"  {r['file']}: {why}{first}")
            bad |= any(r["failed"] or r["errors"] or r["import_errors"] for r in rows)
        if not a.no_examples:
            recs = run_examples(root, a.timeout)
            print(f"\nexamples import ({len(recs)} modules):")
            counts: dict[str, int] = {}
            for r in recs:
                key = r["class"].split(" (")[0] if r["class"].startswith("needs") else r["class"]
                counts[key] = counts.get(key, 0) + 1
            print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
                  + f"; using a Sample attribute absent here: {sum(bool(r.get('sample_missing')) for r in recs)}")
            for r in recs:
                detail = "" if r["class"] == "ok" else f"  -- {r.get('message', '')}"
                if r["class"].startswith("needs"):
                    detail = f"  -- refused: {r.get('refusal', '')}"
                print(f"  {r['class']:<16} {r['file']}{detail}")
                if r.get("sample_missing"):
                    print(f"  {'':<16} {'':<4}uses what Miles's Sample has and this package's lacks: "
                          f"{', '.join(r['sample_missing'])}")
            bad |= any(r["class"] in ("MISSING", "ERROR") or "NOT refused" in r["class"] for r in recs)
    finally:
        if a.keep:
            print(f"\nkept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if (a.strict and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
