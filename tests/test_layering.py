"""Imports flow one way (docs/architecture.md): ``tiers/`` and ``eviction/`` import only the
leaf modules of ``kvstore/``; ``kvstore/wire`` (the wire formats) only those and itself;
``kvstore/client`` and ``kvstore/route`` never the daemon (``kvstore/server``); no package imports
an underscore-private name of another package
(a private name is visible in the package that holds it and that package's subpackages), and no
subclass of another package's class overrides, reads or writes a private attribute of its base
(``def _load``, ``self._ring``: a public extension point instead); the
product (``kvstore/``, ``tiers/``, ``eviction/``, ``engine/``) imports nothing from ``tools/``;
the engine adapters (``engine/vllm``, ``engine/sglang``) import no reference engine
(``engine/reference``); nothing outside ``tools/lab`` imports the lab, and the lab, which is
research, is the one place that may reach into private names. Walks every module's imports with
``ast`` (function-level and ``TYPE_CHECKING`` imports included), so an upward import fails here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEAVES = {"keys", "block", "errors", "units", "clock", "buffers", "shm", "api", "tree"}
LOWER = ("tiers", "eviction")
WIRE = "kvstore/wire"
CLIENTS = ("kvstore/client", "kvstore/route")
FIRST_PARTY = ("kvstore", "tiers", "eviction", "engine", "tools")
PRODUCT = ("kvstore", "tiers", "eviction", "engine")
ADAPTERS = ("engine/vllm", "engine/sglang")
LAB = "tools/lab"


def _modules(where: str) -> list[Path]:
    return sorted(p for p in (ROOT / where).rglob("*.py") if ".venv" not in p.parts)


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name != "__init__" else rel.parts[:-1]
    return ".".join(parts)


def _import_rows(tree: ast.Module, package: str) -> Iterator[tuple[int, str, str | None, str | None]]:
    """``(line, module, name, as)`` of every import in a module of ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, None, a.asname
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            for a in node.names:
                yield node.lineno, module, a.name, a.asname


def imports(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import in ``path`` (``name`` None for ``import m``),
    relative imports resolved against the module's package."""
    tree = ast.parse(path.read_text(), str(path))
    for line, module, name, _ in _import_rows(tree, _package_of(path)):
        yield line, module, name


def upward(path: Path, own: str | None = None) -> list[str]:
    """Imports of kvstore modules other than the leaves (and ``kvstore.<own>``), from a tier, a
    policy or a wire format."""
    out = []
    for line, module, name in imports(path):
        parts = module.split(".")
        if parts[0] != "kvstore":
            continue
        target = parts[1] if len(parts) > 1 else name
        if target not in LEAVES and target != own:
            out.append(f"{path.relative_to(ROOT)}:{line}: imports {module}{'.' + name if name and len(parts) == 1 else ''}")
    return out


def daemon(path: Path) -> list[str]:
    """Imports of the daemon's package (``kvstore.server``), from a client or the router."""
    out = []
    for line, module, name in imports(path):
        parts = module.split(".")
        if parts[:2] == ["kvstore", "server"] or (parts == ["kvstore"] and name == "server"):
            out.append(f"{path.relative_to(ROOT)}:{line}: imports kvstore.server")
    return out


def _owner(prefix: list[str]) -> str:
    """The package that holds the private name ending ``prefix``: the name's own package when it
    is one (``tools.bench._peers``), else the package of the module it is in."""
    return ".".join(prefix) if (ROOT / "/".join(prefix)).is_dir() else ".".join(prefix[:-1])


def private(path: Path) -> list[str]:
    """Imports of underscore-private modules or names of another first-party package."""
    own = _package_of(path)
    out = []
    for line, module, name in imports(path):
        parts = module.split(".")
        if parts[0] not in FIRST_PARTY:
            continue
        full = [*parts, name] if name else parts
        for i, part in enumerate(full[1:], 1):
            if part.startswith("_") and not part.startswith("__"):
                owner = _owner(full[:i])
                if own != owner and not own.startswith(owner + "."):
                    out.append(f"{path.relative_to(ROOT)}:{line}: imports private {'.'.join(full[: i + 1])}")
                break
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _bound_names(tree: ast.Module, path: Path) -> dict[str, tuple[str, str | None]]:
    """``{local name: (module, name)}`` of a module's first-party imports (``name`` None for a
    module imported whole)."""
    out: dict[str, tuple[str, str | None]] = {}
    for _, module, name, asname in _import_rows(tree, _package_of(path)):
        if name or asname:
            out[asname or name or module] = (module, name)
        else:  # import a.b binds a
            out[module.split(".")[0]] = (module.split(".")[0], None)
    return {k: v for k, v in out.items() if v[0].split(".")[0] in FIRST_PARTY}


def _resolve(expr: ast.expr, bound: dict[str, tuple[str, str | None]]) -> tuple[str, str] | None:
    """``(module, class)`` of a base-class expression that names a first-party class."""
    dotted: list[str] = []
    while isinstance(expr, ast.Attribute):
        dotted.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in bound:
        return None
    module, name = bound[expr.id]
    parts = [*module.split("."), *([name] if name else []), *dotted]
    for n in range(len(parts) - 1, 0, -1):
        if _module_file(".".join(parts[:n])) and n == len(parts) - 1:
            return ".".join(parts[:n]), parts[-1]
    return None


def _find_class(module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef, ast.Module] | None:
    """A class by the module that defines it or re-exports it (followed a few imports deep)."""
    path = _module_file(module)
    if path is None or depth > 4:
        return None
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node, tree
    source = _bound_names(tree, path).get(name)
    if source and source[1]:
        return _find_class(source[0], source[1], depth + 1)
    return None


def _class_level(cls: ast.ClassDef) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of the methods and class attributes a class body defines."""
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.lineno, node.name
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        yield from ((t.lineno, t.id) for t in targets if isinstance(t, ast.Name))


def _own_privates(cls: ast.ClassDef) -> set[str]:
    """Private names a class defines: methods and class attributes, and ``self._x`` it sets or reads."""
    out = {name for _, name in _class_level(cls) if _is_private(name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            out.add(node.attr)
    return out


def _base_privates(module: str, cls: ast.ClassDef, tree: ast.Module, seen: set[str]) -> set[str]:
    """Private names of a first-party class and of its first-party bases."""
    if f"{module}.{cls.name}" in seen:
        return set()
    seen.add(f"{module}.{cls.name}")
    out = _own_privates(cls)
    path = _module_file(module)
    bound = _bound_names(tree, path) if path else {}
    for base in cls.bases:
        target = _resolve(base, bound)
        if target is None and isinstance(base, ast.Name):
            target = (module, base.id)
        found = _find_class(*target) if target else None
        if found:
            out |= _base_privates(*found, seen)
    return out


def foreign_privates(path: Path) -> list[str]:
    """Private attributes of another package's class that a subclass here overrides, reads or
    writes (``def _x``, ``_x = ...``, ``self._x``, ``super()._x``)."""
    own = _package_of(path)
    tree = ast.parse(path.read_text(), str(path))
    bound = _bound_names(tree, path)
    out = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        privates: set[str] = set()
        for base in cls.bases:
            target = _resolve(base, bound)
            if target is None:
                continue
            owner = _owner(target[0].split("."))
            if own == owner or own.startswith(owner + "."):
                continue
            found = _find_class(*target)
            if found:
                privates |= _base_privates(*found, set())
        if not privates:
            continue
        used = [*_class_level(cls), *(
            (node.lineno, node.attr) for node in ast.walk(cls) if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                or (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and node.value.func.id == "super")))]
        out += [f"{path.relative_to(ROOT)}:{line}: {cls.name} uses {name} of its base" for line, name in used if name in privates]
    return sorted(set(out), key=lambda v: (v.split(":")[0], int(v.split(":")[1]), v))


def reaching(path: Path, target: str) -> list[str]:
    """Imports of ``target`` (a dotted package) or anything under it."""
    return [f"{path.relative_to(ROOT)}:{line}: imports {module}{'.' + name if name and module == target.rpartition('.')[0] else ''}"
            for line, module, name in imports(path)
            if module == target or module.startswith(target + ".")
            or (name and f"{module}.{name}" == target)]


def _outside_lab(where: str) -> list[Path]:
    return [p for p in _modules(where) if not p.relative_to(ROOT).as_posix().startswith(LAB + "/")]


@pytest.mark.parametrize("where", LOWER)
def test_tiers_and_policies_import_only_leaf_modules_of_kvstore(where: str) -> None:
    assert [v for p in _modules(where) for v in upward(p)] == []


def test_wire_formats_import_only_leaf_modules_of_kvstore() -> None:
    assert _modules(WIRE)
    assert [v for p in _modules(WIRE) for v in upward(p, own="wire")] == []


@pytest.mark.parametrize("where", CLIENTS)
def test_clients_and_the_router_never_import_the_daemon(where: str) -> None:
    assert [v for p in _modules(where) for v in daemon(p)] == []


def test_the_sglang_backend_does_not_import_the_vllm_adapter() -> None:
    """Both adapters share ``engine/breaker.py``; neither imports the other."""
    found = [f"{p.relative_to(ROOT)}:{line}: imports {module}" for p in _modules("engine/sglang")
             for line, module, _ in imports(p) if module.split(".")[:2] == ["engine", "vllm"]]
    assert found == []


@pytest.mark.parametrize("where", FIRST_PARTY)
def test_no_package_imports_another_ones_private_names(where: str) -> None:
    assert [v for p in _outside_lab(where) for v in private(p)] == []


@pytest.mark.parametrize("where", FIRST_PARTY)
def test_no_subclass_uses_another_packages_private_attributes(where: str) -> None:
    assert [v for p in _outside_lab(where) for v in foreign_privates(p)] == []


@pytest.mark.parametrize("where", PRODUCT)
def test_the_product_imports_nothing_from_tools(where: str) -> None:
    assert [v for p in _modules(where) for v in reaching(p, "tools")] == []


@pytest.mark.parametrize("where", ADAPTERS)
def test_the_adapters_import_no_reference_engine(where: str) -> None:
    assert [v for p in _modules(where) for v in reaching(p, "engine.reference")] == []


@pytest.mark.parametrize("where", FIRST_PARTY)
def test_nothing_outside_the_lab_imports_it(where: str) -> None:
    assert [v for p in _outside_lab(where) for v in reaching(p, "tools.lab")] == []


def test_the_checks_catch_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.test_layering.ROOT", tmp_path)
    (tmp_path / "tiers").mkdir()
    bad = tmp_path / "tiers" / "bad.py"
    bad.write_text("from kvstore.keys import BlockHash\nfrom kvstore.store import KVStore\n"
                   "def f():\n    from kvstore import index\n")
    assert upward(bad) == ["tiers/bad.py:2: imports kvstore.store", "tiers/bad.py:4: imports kvstore.index"]
    (tmp_path / "kvstore" / "wire").mkdir(parents=True)
    wire = tmp_path / "kvstore" / "wire" / "bad.py"
    wire.write_text("from kvstore.wire import protocol\nfrom kvstore.keys import Namespace\n"
                    "from kvstore.server.limits import Limits\n")
    assert upward(wire, own="wire") == ["kvstore/wire/bad.py:3: imports kvstore.server.limits"]
    (tmp_path / "kvstore" / "client").mkdir()
    client = tmp_path / "kvstore" / "client" / "bad.py"
    client.write_text("from kvstore.wire import protocol\nfrom kvstore.server import protocol as P\n"
                      "def f():\n    from kvstore import server\n")
    assert daemon(client) == ["kvstore/client/bad.py:2: imports kvstore.server", "kvstore/client/bad.py:4: imports kvstore.server"]
    (tmp_path / "engine").mkdir()
    caller = tmp_path / "engine" / "bad.py"
    caller.write_text("from kvstore.store import _dst_views\nfrom kvstore.store._common import LookupResult\n"
                      "from kvstore.api import KVCacheAPI\n")
    assert private(caller) == [
        "engine/bad.py:1: imports private kvstore.store._dst_views",
        "engine/bad.py:2: imports private kvstore.store._common",
    ]
    (tmp_path / "tools" / "bench").mkdir(parents=True)
    bench = tmp_path / "tools" / "bench" / "bad.py"
    bench.write_text("from tools import lab\nfrom tools.lab.replay import bounds\nfrom engine.reference.batch import _Plan\n"
                     "from tools.bench._common import result\n")
    assert reaching(bench, "tools.lab") == ["tools/bench/bad.py:1: imports tools.lab", "tools/bench/bad.py:2: imports tools.lab.replay"]
    assert private(bench) == ["tools/bench/bad.py:3: imports private engine.reference.batch._Plan"]
    (tmp_path / "engine" / "lm.py").write_text(
        "class LM:\n    def __init__(self):\n        self._buf = 0\n    def _plan(self):\n        return self._buf\n"
        "    def plan(self):\n        return self._plan()\n")
    sub = tmp_path / "tools" / "bench" / "sub.py"
    sub.write_text("from engine.lm import LM\nimport engine.lm as m\n\nclass A(LM):\n    def _plan(self):\n        return self._buf\n"
                   "\nclass B(m.LM):\n    _own = 1\n    def plan(self):\n        return super()._plan() + self._own\n"
                   "\nimport engine.lm\nclass D(engine.lm.LM):\n    _plan = None\n")
    assert foreign_privates(sub) == ["tools/bench/sub.py:5: A uses _plan of its base", "tools/bench/sub.py:6: A uses _buf of its base",
                                     "tools/bench/sub.py:11: B uses _plan of its base", "tools/bench/sub.py:15: D uses _plan of its base"]
    (tmp_path / "engine" / "sub.py").write_text("from engine.lm import LM\n\nclass C(LM):\n    def _plan(self):\n        return 1\n")
    assert foreign_privates(tmp_path / "engine" / "sub.py") == []
    adapter = tmp_path / "engine" / "vllm.py"
    adapter.write_text("import engine.reference.hf\nfrom engine import reference\nfrom engine.client import EngineCache\n")
    assert reaching(adapter, "engine.reference") == ["engine/vllm.py:1: imports engine.reference.hf", "engine/vllm.py:2: imports engine.reference"]
