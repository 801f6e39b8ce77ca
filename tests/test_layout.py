"""The package's layering (CONTRIBUTING.md): every import, lazy ones included, goes down the
table or stays in its row, and no module imports another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fusedmoe"

# (prefix, rank): the longest matching prefix wins; higher ranks may import lower ones
RANKS = [
    ("fusedmoe", 8),  # the package's __init__ gathers the public names
    ("fusedmoe.__main__", 8),
    ("fusedmoe.tools", 7),
    ("fusedmoe.integrations", 7),
    ("fusedmoe.layer", 6),
    ("fusedmoe.layer_backends", 6),  # the layer's backend choice and runners
    ("fusedmoe.layer_graphs", 6),  # the layer's calls replayed from CUDA graphs
    ("fusedmoe.functional", 6),
    ("fusedmoe.weights", 6),
    ("fusedmoe.parallel", 6),
    ("fusedmoe.parallel.config", 1),  # plain placement arithmetic, no collectives
    ("fusedmoe.parallel.placement", 1),
    ("fusedmoe.oracle", 5),
    ("fusedmoe.experts", 4),
    ("fusedmoe.modular", 3),
    ("fusedmoe.kernels", 2),
    ("fusedmoe.quant", 1),
    ("fusedmoe.router", 1),
    ("fusedmoe.activation", 0),
    ("fusedmoe._checks", 0),
    ("fusedmoe._triton", 0),
    ("fusedmoe._pdl", 0),  # launch infrastructure of every kernel module (imports triton)
    ("fusedmoe._paths", 0),
]


def rank(module: str) -> int:
    best = max(
        (p for p, _ in RANKS if module == p or module.startswith(p + ".")), key=len, default=None
    )
    if best is None:
        raise AssertionError(f"{module} is in no row of the layering table")
    return dict(RANKS)[best]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (annotations only, never imported)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _is_module(dotted: str) -> bool:
    base = ROOT.parent / dotted.replace(".", "/")
    return base.is_dir() or base.with_suffix(".py").exists()


def imports(path: Path, type_checking: bool = False) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) of every fusedmoe import in the file, lazy ones included
    (`from pkg import module` counts as importing the module); those under `if TYPE_CHECKING:`
    too when type_checking is set."""
    found = []
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "fusedmoe":
                names = [a.name for a in node.names]
                subs = [
                    f"{node.module}.{n}"
                    for n in names
                    if (ROOT.parent / (node.module + "." + n).replace(".", "/")).exists()
                    or (ROOT.parent / (node.module + "." + n).replace(".", "/"))
                    .with_suffix(".py")
                    .exists()
                ]
                targets = subs or [node.module]
                for target in targets:
                    found.append((node.lineno, target, names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fusedmoe":
                    found.append((node.lineno, alias.name, []))
    return found


FILES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_the_layers(path):
    me = module_name(path)
    for line, target, _ in imports(path):
        assert rank(target) <= rank(me), (
            f"{me}:{line} imports {target}, a higher layer ({rank(target)} > {rank(me)})"
        )


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_names_cross_modules(path):
    me = module_name(path)
    for line, target, names in imports(path):
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        assert target == me or not private, f"{me}:{line} imports {private} from {target}"


#: (importer prefix, imported prefix) pairs that never meet, annotations included: the modular
#: seams define what parallel code implements (the DP dispatch a monolithic backend is handed is
#: a modular.types.TokenDispatch), never the other way
NEVER = [("fusedmoe.modular", "fusedmoe.parallel")]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_forbidden_imports(path):
    me = module_name(path)
    for line, target, _ in imports(path, type_checking=True):
        for importer, imported in NEVER:
            assert not (_under(me, importer) and _under(target, imported)), (
                f"{me}:{line} imports {target}: {importer} never imports {imported}"
            )


def import_cycle(package: str) -> list[str] | None:
    """A cycle of imports (lazy ones included) among the modules of `package`, or None."""
    graph = {
        module_name(path): {target for _, target, _ in imports(path) if _under(target, package)}
        for path in FILES
        if _under(module_name(path), package)
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_router_modules_import_no_cycle():
    """The routers' checks live below both the routers and the fused routing kernels: the
    kernels' module (which imports triton) imports no router, and no router module imports
    itself round a circle (a lazy import included)."""
    cycle = import_cycle("fusedmoe.router")
    assert cycle is None, "router modules import in a cycle: " + " -> ".join(cycle)


def test_the_table_catches_an_upward_import(tmp_path):
    """The check can fail: a kernel importing the layer is flagged."""
    assert rank("fusedmoe.layer") > rank("fusedmoe.kernels.fused_moe")
    assert rank("fusedmoe.quant.kernels") < rank("fusedmoe.kernels.moe_gemm")
