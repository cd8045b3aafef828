"""The package layering, read from the imports of every module under pdcache/.

Lower packages may not import higher ones; packages on the same level may not import each
other unless `SAME_LEVEL` lists the pair. Every import counts: module-level or inside a
function, `import x` or `from x import y`, relative ones resolved, and the "pkg.module:attr"
strings handed to a registry or to `importlib.import_module` (they are imports, only later).

    0  kernels, utils           (and pdcache/__init__.py)
    1  engine
    2  offload_manager (its storage/ too), transfer     -- neither imports the other
    3  config, wire                                    -- neither imports the other
    4  server
    5  prefill_node, decode_node, router                -- none imports another; the router
                                                           imports no server module (wire is
                                                           what it shares with the servers)
    6  launch, bench, chaos, cli (pdcache/cli.py, __main__.py), integrations
    7  sim                                              -- drives the real trees, policies and
                                                           router code; reads traces with bench's
                                                           own code

bench's replay (pdcache/bench/replay.py and every bench module it imports, transitively) talks
to a running stack over HTTP only: it imports nothing of pdcache but bench/, utils/ and the pure
page-key functions of engine/page_keys.py (the chain every server computes; no engine, no I/O).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "pdcache"

LEVELS: dict[str, int] = {
    "pdcache": 0,  # pdcache/__init__.py: the version, nothing else
    "kernels": 0,
    "utils": 0,
    "engine": 1,
    "offload_manager": 2,
    "transfer": 2,
    "config": 3,
    "wire": 3,
    "server": 4,
    "prefill_node": 5,
    "decode_node": 5,
    "router": 5,
    "launch": 6,
    "bench": 6,
    "chaos": 6,
    "cli": 6,
    "integrations": 6,
    "sim": 7,
}

# (importer, imported) pairs on one level that are allowed, with the reason.
SAME_LEVEL: dict[tuple[str, str], str] = {
    ("kernels", "utils"): "the kernel backends are a utils.registry",
    ("bench", "integrations"): "`pdcache bench sglang-plugin` measures the SGLang plugin",
    ("chaos", "bench"): "the soak launches with bench's stack launcher and plays sessions with "
                        "the replay's player",
}

# Downward pairs that are not allowed all the same, with the rule named in the failure message.
NEVER: dict[tuple[str, str], str] = {
    ("router", "server"): "the router imports no server module: server/ is engine-facing, what "
                          "the router shares with the servers is wire/",
}

# Same-level pairs with a rule of their own, named in the failure message.
NAMED_RULES: dict[frozenset[str], str] = {
    frozenset({"prefill_node", "decode_node"}):
        "prefill_node and decode_node never import each other",
    frozenset({"router", "prefill_node"}): "the router imports neither node package",
    frozenset({"router", "decode_node"}): "the router imports neither node package",
    frozenset({"offload_manager", "transfer"}):
        "offload_manager and transfer never import each other",
}

REPLAY = "pdcache.bench.replay"
REPLAY_MAY_IMPORT = frozenset({"bench", "utils"})
REPLAY_MAY_IMPORT_MODULES = frozenset({"pdcache.engine.page_keys"})  # pure functions
# Calls whose first string argument names a module to import.
DYNAMIC_IMPORTERS = frozenset({"import_module", "import_optional", "register", "__import__"})


@dataclass(frozen=True)
class Import:
    """One import of a pdcache module by a pdcache module."""

    path: str  # the importing file, relative to the repository: pdcache/server/app.py
    line: int
    importer: str  # pdcache.server.app
    target: str  # pdcache.launch.topology (the module, or the package if y is not a module)
    text: str  # the statement as written

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Module:
    name: str  # dotted: pdcache.offload_manager.storage.file
    path: str  # relative file name, used in messages
    source: str
    is_package: bool  # an __init__.py


def package_of(module: str) -> str:
    """The layering package of a dotted pdcache module name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "pdcache"
    if parts[1] in ("cli", "__main__"):
        return "cli"
    return parts[1]


def load_modules(package_dir: Path = PACKAGE_DIR) -> list[Module]:
    modules = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir.parent)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules.append(Module(name, rel.as_posix(), path.read_text(), is_package))
    return modules


def _statement(module: Module, node: ast.AST) -> str:
    text = ast.get_source_segment(module.source, node) or ast.unparse(node)
    return " ".join(text.split())


def _resolve_from(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _dynamic_target(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in DYNAMIC_IMPORTERS:
        return None
    for arg in node.args[:2]:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            target = arg.value.partition(":")[0]
            if target == "pdcache" or target.startswith("pdcache."):
                return target
    return None


def imports_of(module: Module, known: Iterable[str]) -> Iterator[Import]:
    """Every pdcache module `module` imports; `known` names the modules that exist, so that
    `from pdcache.bench import report` resolves to the module pdcache.bench.report."""
    known = set(known)
    tree = ast.parse(module.source, module.path)
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, node)
            subs = [f"{base}.{alias.name}" for alias in node.names]
            targets = [sub if sub in known else base for sub in subs]
        elif isinstance(node, ast.Call):
            target = _dynamic_target(node)
            targets = [target] if target else []
        for target in dict.fromkeys(targets):
            if target == "pdcache" or target.startswith("pdcache."):
                text = _statement(module, node)
                yield Import(module.path, node.lineno, module.name, target, text)


def all_imports(modules: Iterable[Module]) -> list[Import]:
    modules = list(modules)
    known = {m.name for m in modules}
    return [imp for m in modules for imp in imports_of(m, known)]


def layering_violations(imports: Iterable[Import]) -> list[str]:
    """One message per import that goes up a level, or sideways without an allowance."""
    found = []
    for imp in imports:
        src, dst = package_of(imp.importer), package_of(imp.target)
        if src == dst or dst == "pdcache":
            continue
        if src not in LEVELS or dst not in LEVELS:
            unknown = src if src not in LEVELS else dst
            found.append(f"{imp.where()}\n    package {unknown!r} has no level in LEVELS")
            continue
        if (src, dst) in NEVER:
            found.append(f"{imp.where()}\n    {NEVER[(src, dst)]}")
            continue
        if LEVELS[dst] < LEVELS[src] or (src, dst) in SAME_LEVEL:
            continue
        if LEVELS[dst] > LEVELS[src]:
            rule = f"{src} (level {LEVELS[src]}) may not import {dst} (level {LEVELS[dst]})"
        else:
            shared = f"{src} and {dst} share level {LEVELS[src]}: neither imports the other"
            rule = NAMED_RULES.get(frozenset({src, dst}), shared)
        found.append(f"{imp.where()}\n    {rule}")
    return found


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def closure(start: str, imports: Iterable[Import], within: str) -> set[str]:
    """`start` and every module of package `within` it imports, directly or not (parent
    packages' __init__ included: importing a.b.c runs a/__init__ and a/b/__init__)."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.importer, set()).update([*_parents(imp.target), imp.target])
    seen, todo = set(), [start]
    while todo:
        mod = todo.pop()
        if mod in seen or package_of(mod) != within:
            continue
        seen.add(mod)
        todo.extend(edges.get(mod, ()))
    return seen


def replay_violations(imports: Iterable[Import], replay: str = REPLAY) -> list[str]:
    imports = list(imports)
    reached = closure(replay, imports, "bench")
    allowed = REPLAY_MAY_IMPORT | {"pdcache"}
    return [f"{imp.where()}\n    bench's replay talks HTTP only: {imp.importer} (reached from "
            f"{replay}) may import only {sorted(REPLAY_MAY_IMPORT)} of pdcache, "
            f"not {package_of(imp.target)}"
            for imp in imports
            if imp.importer in reached and package_of(imp.target) not in allowed
            and imp.target not in REPLAY_MAY_IMPORT_MODULES]


def _fail(kind: str, found: list[str]) -> None:
    if found:
        pytest.fail(f"{len(found)} {kind}:\n" + "\n".join(found), pytrace=False)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return all_imports(load_modules())


def test_every_package_has_a_level() -> None:
    names = {package_of(m.name) for m in load_modules()}
    assert names <= set(LEVELS), f"packages without a level: {sorted(names - set(LEVELS))}"


def test_no_upward_imports(imports: list[Import]) -> None:
    _fail("imports against the layering", layering_violations(imports))


def test_replay_talks_http_only(imports: list[Import]) -> None:
    assert REPLAY in {imp.importer for imp in imports}, "pdcache/bench/replay.py imports nothing?"
    _fail("imports of bench's replay outside bench/ and utils/", replay_violations(imports))


# --- the checker itself ----------------------------------------------------------------------

def _synthetic(sources: Mapping[str, str]) -> list[Import]:
    modules = [Module(name, name.replace(".", "/") + ".py", src, False)
               for name, src in sources.items()]
    return all_imports(modules)


def test_checker_catches_an_upward_import() -> None:
    found = layering_violations(_synthetic({
        "pdcache.engine.fake": (
            "from __future__ import annotations\n"
            "import pdcache.kernels\n"
            "from pdcache.utils.registry import Registry\n"
            "\n"
            "def late():\n"
            "    from ..server import app\n"
            "    return app\n"
        ),
    }))
    assert len(found) == 1, found
    assert found[0].startswith("pdcache/engine/fake.py:6: from ..server import app")
    assert "engine (level 1) may not import server (level 4)" in found[0]


def test_checker_resolves_imports_of_submodules_and_registry_strings() -> None:
    imports = _synthetic({
        "pdcache.transfer.fake": (
            "from pdcache import config\n"
            "import pdcache.offload_manager.storage.file as f\n"
            "ENGINES.register('x', 'pdcache.router.app:App')\n"
        ),
        "pdcache.config": "",
        "pdcache.router.app": "",
    })
    assert [(i.line, i.target) for i in imports] == [
        (1, "pdcache.config"),
        (2, "pdcache.offload_manager.storage.file"),
        (3, "pdcache.router.app"),
    ]
    found = layering_violations(imports)
    assert "transfer (level 2) may not import config (level 3)" in found[0]
    assert "offload_manager and transfer never import each other" in found[1]
    assert "transfer (level 2) may not import router (level 5)" in found[2]


def test_checker_names_the_node_rule_and_allows_listed_pairs() -> None:
    found = layering_violations(_synthetic({
        "pdcache.decode_node.cli": "from pdcache.prefill_node.cli import add_arguments\n",
        "pdcache.kernels.dispatch": "from pdcache.utils.registry import Registry\n",
        "pdcache.cli": "from pdcache.launch import cli\n",
        "pdcache.router.app": ("from pdcache.wire.protocol import ApiError\n"
                               "from pdcache.server.routes import mount\n"),
    }))
    assert len(found) == 3, found
    assert "prefill_node and decode_node never import each other" in found[0]
    assert "cli and launch share level 6" in found[1]
    assert found[2].startswith("pdcache/router/app.py:2: from pdcache.server.routes import")
    assert "the router imports no server module" in found[2]


def test_replay_checker_follows_bench_imports() -> None:
    imports = _synthetic({
        "pdcache.bench.replay": "def main():\n    from pdcache.bench import tokens\n",
        "pdcache.bench.tokens": ("from pdcache.utils.registry import Registry\n"
                                 "from pdcache.engine.page_keys import chain_page_keys\n"
                                 "from pdcache.engine.engine import Engine\n"),
        "pdcache.bench.other": "from pdcache.server import app\n",
    })
    found = replay_violations(imports)
    assert len(found) == 1, found
    assert found[0].startswith(
        "pdcache/bench/tokens.py:3: from pdcache.engine.engine import Engine")
