"""Every config field is read by a plane that honours it, or is listed, with its reason, as refused or parse-only.

A static scan of miles/ (outside miles/config) finds where each field of each config section is read: an
attribute ``x.<field>``, a string constant ``"<field>"`` (``getattr(x, "<field>")``, tables of field names),
or through a helper of miles/config that reads it (a property such as ``TrainConfig.activation_checkpointing``,
``resolve_eval_datasets`` ...; its checks and the parser's registration do not count). Then:

- a field of a trainer section (``support.TRAINER_SECTIONS``) must be read, for each backend, by shared code or
  by that backend's modules, or be refused on that backend (``support.BACKEND_ONLY``, or its whole section in
  ``support.SECTION_BACKEND``), or be ``support.PARSE_ONLY``;
- any other field must be read somewhere, or be ``support.PARSE_ONLY``;
- a ``PARSE_ONLY`` field that code reads fails too: drop the entry.

Modules are classified by path (``MODULE_KINDS``): miles/trainer/megatron/** is the Megatron backend,
miles/trainer/fsdp* (fsdp.py, fsdp_*.py, fsdp/**) the FSDP one, the rest shared; a shared-path trainer module
imported by one backend only (miles/trainer/lora.py) is that backend's. No backend class subclasses a class of the
other backend (checked below), so what a backend runs is its own modules, shared ones, and the other backend's
functions it imports.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from miles.config import ConfigError, MilesConfig, parse_args, support
from miles.config.base import flag
from miles.config.support import BACKEND_ONLY, BACKENDS, PARSE_ONLY, SECTION_BACKEND, TRAINER_SECTIONS

REPO = Path(__file__).resolve().parents[3]

MODULE_KINDS: tuple[tuple[str, str], ...] = (
    ("miles/config/", "config"),
    ("miles/trainer/megatron/", "megatron"),
    ("miles/trainer/fsdp", "fsdp"),
)
TRAINER_PREFIX = "miles/trainer/"
# config helpers whose reads do not honour a field: checks, the list of what was given, the parser's registration
NOT_CONSUMERS = ("validate", "_validate", "check", "_check", "refuse", "given", "add_", "_add_", "flag_docs", "__")


def path_kind(rel: str) -> str:
    for prefix, kind in MODULE_KINDS:
        if rel.startswith(prefix):
            return kind
    return "shared"


@dataclass(frozen=True)
class Reads:
    fields: frozenset[str]     # attribute loads ``x.name`` and identifier-like string constants
    refs: frozenset[str]       # those and bare names: the helpers a piece of code uses


@dataclass
class Module:
    rel: str
    name: str
    kind: str
    reads: Reads
    defs: dict[str, Reads] = field(default_factory=dict)      # top-level functions and assignments
    classes: dict[str, tuple[list[str], dict[str, Reads]]] = field(default_factory=dict)
    imports: set[str] = field(default_factory=set)
    imported_names: dict[str, str] = field(default_factory=dict)   # local name -> "module:name"


def _skipped(tree: ast.AST) -> set[int]:
    """Docstrings and the pieces of f-strings: text, not names."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
        if isinstance(n, ast.JoinedStr):
            out |= {id(v) for v in n.values}
    return out


def reads_of(nodes: list[ast.AST], skip: set[int]) -> Reads:
    fields: set[str] = set()
    refs: set[str] = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                fields.add(n.attr)
            elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
                  and n.value.isidentifier()):
                fields.add(n.value)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                refs.add(n.id)
    return Reads(frozenset(fields), frozenset(refs | fields))


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_module(root: Path, path: Path) -> Module:
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=rel)
    skip = _skipped(tree)
    m = Module(rel=rel, name=_module_name(rel), kind=path_kind(rel), reads=reads_of([tree], skip))
    pkg = m.name if rel.endswith("__init__.py") else m.name.rpartition(".")[0]
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            m.imports |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - (n.level - 1)] + ([base] if base else []))
            m.imports.add(base)
            for a in n.names:
                m.imports.add(f"{base}.{a.name}")                 # `from miles.trainer import lora`
                m.imported_names[a.asname or a.name] = f"{base}:{a.name}"
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            m.defs[n.name] = reads_of([n], skip)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    m.defs[t.id] = reads_of([n.value], skip)
        elif isinstance(n, ast.ClassDef):
            methods = {b.name: reads_of([b], skip) for b in n.body
                       if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))}
            bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in n.bases]
            m.classes[n.name] = (bases, methods)
    return m


def load_modules(root: Path) -> dict[str, Module]:
    mods = {m.name: m for m in (load_module(root, p) for p in sorted((root / "miles").rglob("*.py")))}
    _refine_kinds(mods)
    return mods


def _reach(m: Module, mods: dict[str, Module]) -> set[str]:
    """The backends a module's code runs for: its own, and the other one's when that one imports it."""
    if m.kind not in BACKENDS:
        return {m.kind}
    return {m.kind} | {o.kind for o in mods.values() if o.kind in BACKENDS and m.name in o.imports}


def _refine_kinds(mods: dict[str, Module]) -> None:
    """A shared-path trainer module that only one backend's code imports belongs to that backend."""
    changed = True
    while changed:
        changed = False
        for m in mods.values():
            if m.kind != "shared" or not m.rel.startswith(TRAINER_PREFIX) or m.rel.endswith("__init__.py"):
                continue
            users = set().union(*(_reach(o, mods) for o in mods.values()
                                  if o is not m and o.kind != "config" and m.name in o.imports))
            if len(users) == 1 and (kind := next(iter(users))) in BACKENDS:
                m.kind, changed = kind, True


def config_helpers(mods: dict[str, Module]) -> dict[str, set[str]]:
    """The functions, tables, methods and properties of miles/config, but the checks and the parser's
    registration (``NOT_CONSUMERS``) -> the names each reads, through the helpers it uses. Keys:
    ``module:name`` for module-level ones, ``.name`` for methods and properties (found by attribute name)."""
    direct: dict[str, Reads] = {}
    scope: dict[str, Module] = {}
    for m in mods.values():
        if m.kind != "config":
            continue
        entries = [(f"{m.name}:{k}", v) for k, v in m.defs.items()]
        entries += [(f".{k}", v) for _bases, methods in m.classes.values() for k, v in methods.items()]
        for key, reads in entries:
            if key.rpartition(":")[2].lstrip(".").startswith(NOT_CONSUMERS):
                continue
            old = direct.get(key, Reads(frozenset(), frozenset()))
            direct[key] = Reads(old.fields | reads.fields, old.refs | reads.refs)
            scope[key] = m
    closed = {k: set(v.fields) for k, v in direct.items()}
    uses = {k: resolve(direct[k].refs, scope[k], mods, closed) - {k} for k in direct}
    changed = True
    while changed:
        changed = False
        for k, reads in closed.items():
            extra = set().union(*(closed[u] for u in uses[k])) - reads
            if extra:
                reads |= extra
                changed = True
    return closed


def resolve(refs: frozenset[str], m: Module, mods: dict[str, Module], helpers: dict[str, set[str]]) -> set[str]:
    """The config helpers that the names ``refs`` of module ``m`` can mean."""
    out = {f".{r}" for r in refs} & helpers.keys()
    for r in refs:
        if f"{m.name}:{r}" in helpers:
            out.add(f"{m.name}:{r}")
        target = m.imported_names.get(r, "")
        if target.replace(":", ".") in mods:           # `from miles.config import sglang` (a module)
            continue
        if target in helpers:
            out.add(target)
        out |= {f"{mod}:{r}" for mod in m.imports if f"{mod}:{r}" in helpers}   # `module.helper`
    return out


def field_readers(mods: dict[str, Module]) -> dict[str, dict[str, set[str]]]:
    """name -> kind (shared / fsdp / megatron) -> where it is read (outside miles/config, or through its helpers)."""
    helpers = config_helpers(mods)
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))

    def add(reads: Reads, kind: str, where: str, mod: Module) -> None:
        for n in reads.fields | set().union(*(helpers[h] for h in resolve(reads.refs, mod, mods, helpers))):
            out[n][kind].add(where)

    for m in mods.values():
        if m.kind == "config":
            continue
        add(m.reads, m.kind, m.rel, m)
        if m.kind not in BACKENDS:
            continue
        # what this backend takes from the other one: functions it imports
        for target in m.imported_names.values():
            mod, _, name = target.partition(":")
            src = mods.get(mod)
            if src is not None and src.kind in BACKENDS and src.kind != m.kind and name in src.defs:
                add(src.defs[name], m.kind, f"{src.rel}:{name} (imported by {m.rel})", src)
    return out


# ----------------------------------------------------------------------------- the checks
@pytest.fixture(scope="module")
def readers() -> dict[str, dict[str, set[str]]]:
    return field_readers(load_modules(REPO))


def config_fields() -> list[tuple[str, str]]:
    """(section, field) for every field of every config section."""
    hints = typing.get_type_hints(MilesConfig)
    return [(s.name, f.name) for s in dataclasses.fields(MilesConfig) if dataclasses.is_dataclass(hints[s.name])
            for f in dataclasses.fields(hints[s.name])]


def problems(readers: dict[str, dict[str, set[str]]], fields: list[tuple[str, str]]) -> list[str]:
    """One line per field that breaks the rules of the module docstring."""
    out = []
    for section, name in fields:
        kinds = set(readers.get(name, {}))
        if name in PARSE_ONLY:
            if kinds:
                out.append(f"{section}.{name} is PARSE_ONLY but read by {sorted(kinds)}: "
                           f"{_where(readers, name)}; drop it from PARSE_ONLY")
            continue
        if section not in TRAINER_SECTIONS:
            if not kinds:
                out.append(f"{section}.{name} ({flag(name)}) is read nowhere: honour it, refuse it, or list it in "
                           "miles/config/support.py PARSE_ONLY with the reason")
            continue
        honoured = set(BACKENDS) if "shared" in kinds else kinds & set(BACKENDS)
        for backend in BACKENDS:
            if backend in honoured:
                continue
            only = SECTION_BACKEND.get(section) or (BACKEND_ONLY[name].backend if name in BACKEND_ONLY else None)
            if only is not None and only != backend:
                continue                        # refused on this backend by validation
            out.append(f"{section}.{name} ({flag(name)}) is not read by the {backend} backend "
                       f"(read: {_where(readers, name) or 'nowhere'}): honour it there, refuse it on {backend} "
                       "(support.BACKEND_ONLY), or list it in support.PARSE_ONLY with the reason")
    return out


def _where(readers, name: str) -> str:
    return "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(readers.get(name, {}).items()))


def test_every_config_field_is_read_refused_or_parse_only(readers):
    assert problems(readers, config_fields()) == []


def test_the_scan_reports_an_unread_field(readers):
    """The test can fail: a field no code reads, of a trainer section and of another one, is reported."""
    unread = "definitely_not_a_miles_flag_xyz"
    assert unread not in readers
    out = problems(readers, [("train", unread), ("rollout", unread)])
    assert len(out) == 3 and "not read by the fsdp backend" in out[0] and "read nowhere" in out[2], out
    # a trainer field read by one backend's modules only
    fsdp_only = {"x_flag": {"fsdp": {"miles/trainer/fsdp.py"}}}
    out = problems(fsdp_only, [("train", "x_flag")])
    assert len(out) == 1 and "not read by the megatron backend" in out[0], out


def test_module_classification():
    mods = load_modules(REPO)
    kinds = {m.rel: m.kind for m in mods.values()}
    assert kinds["miles/trainer/megatron/trainer.py"] == "megatron" and kinds["miles/trainer/fsdp.py"] == "fsdp"
    assert kinds["miles/trainer/lora.py"] == "shared"            # imported by both backends (LoRA spec, init)
    assert kinds["miles/trainer/lora_hf.py"] == "fsdp"
    assert kinds["miles/trainer/losses.py"] == "shared" and kinds["miles/run/loop.py"] == "shared"
    assert kinds["miles/config/train.py"] == "config"


def test_lists_name_real_fields():
    fields = {name for _section, name in config_fields()}
    assert set(PARSE_ONLY) <= fields and set(BACKEND_ONLY) <= fields
    assert set(SECTION_BACKEND) <= set(TRAINER_SECTIONS)


def test_no_backend_class_subclasses_the_other_backends():
    """Backends are siblings under the shared step (miles/trainer/step.py): a class of one backend deriving from a
    class of the other would run the other's methods on its own model (issue 21: p2p on Megatron took FSDP's
    shard iterator)."""
    mods = load_modules(REPO)
    defined = {(m.name, c): m.kind for m in mods.values() for c in m.classes}
    bad = []
    for m in mods.values():
        if m.kind not in BACKENDS:
            continue
        for cname, (bases, _methods) in m.classes.items():
            for base in bases:
                mod, _, bname = m.imported_names.get(base, f"{m.name}:{base}").partition(":")
                kind = defined.get((mod, bname))
                if kind in BACKENDS and kind != m.kind:
                    bad.append(f"{m.rel}:{cname} subclasses {mod}.{bname} ({kind})")
    assert not bad, bad


BASE = ["--num-rollout", "2", "--rollout-batch-size", "4"]
LORA = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "experts_shared_outer_loras")


def _given(name: str, unset) -> list[str]:
    """Command-line tokens that set ``name`` to a value other than ``unset``."""
    if unset is False:
        return [flag(name)]
    value = {"attn_implementation": "flash_attention_3", "megatron_to_hf_mode": "bridge", "lora_rank": "8",
             "lora_alpha": "32", "lora_dropout": "0.1", "target_modules": "all-linear",
             "exclude_modules": "o_proj", "qkv_format": "bshd"}[name]
    return [flag(name), value]


@pytest.mark.parametrize("name", sorted(BACKEND_ONLY))
def test_backend_only_flags_are_refused_on_the_other_backend(name):
    only = BACKEND_ONLY[name]
    other = next(b for b in BACKENDS if b != only.backend)
    argv = BASE + ["--train-backend", other, *_given(name, only.unset)]
    with pytest.raises(ConfigError) as ei:
        parse_args(argv)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(flag(name)) and f"--train-backend {other}" in msg, msg
    lora = ["--lora-rank", "8", "--target-modules", "all-linear"] if name in LORA else []
    parse_args(BASE + ["--train-backend", only.backend, *lora, *_given(name, only.unset)])   # its own backend takes it


def test_backend_only_refusal_names_flag_value_and_backend():
    with pytest.raises(ConfigError) as ei:
        parse_args(BASE + ["--train-backend", "fsdp", "--megatron-to-hf-mode", "bridge"])
    assert str(ei.value).startswith("--megatron-to-hf-mode bridge is not supported by --train-backend fsdp (only by "
                                    "--train-backend megatron): drop it")


def test_parse_only_flags_are_documented():
    text = (REPO / "docs" / "flags.md").read_text()
    for name in PARSE_ONLY:
        assert f"`{flag(name)}`" in text
    assert support.flag_docs()[0] in text
