"""Measure the package's shape: file and function lengths, import direction between layers, import cycles,
and how many classes declare a given setting.

Layers, lowest first (a module may import from its own layer and the ones below, never from above):

0. ``errors``, ``types``, ``registry``, ``configtypes``, ``embedded``, ``policies``, ``hashing``, ``processes``: plain data
   and helpers;
1. ``tokenization``, ``stitching``, ``chunking``, ``answers``, ``verifiers``, ``scoring``, ``rl`` (``rl`` imports nothing of
   memagent but ``errors``);
2. ``backends``;
3. ``data``, ``runfiles``;
4. ``agent``;
5. ``eval``;
6. ``train``, ``export`` (a run's trained policy as standard model files; training pushes LoRA GGUFs to its
   llama.cpp rollout engine);
7. the command line: ``cli``, ``options``, ``__main__`` and every package's ``cli`` module; and the package's own
   ``__init__`` (its public names, gathered from every layer).

Imports inside functions count too (they are the lazy imports that keep ``memagent run`` free of torch).
Cycles are looked for among modules, with every import counted.

Run::

    python benchmarks/architecture_check.py          # prints every measure; exit status 1 on a violation
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "memagent"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

LAYERS = {
    "errors": 0, "types": 0, "registry": 0, "configtypes": 0, "embedded": 0, "policies": 0, "hashing": 0, "processes": 0,
    "tokenization": 1, "stitching": 1, "chunking": 1, "answers": 1, "verifiers": 1, "scoring": 1, "rl": 1,
    "backends": 2,
    "data": 3, "runfiles": 3,
    "agent": 4,
    "eval": 5,
    "train": 6, "export": 6,
    "cli": 7, "options": 7, "__main__": 7,
}


def modules() -> dict[str, Path]:
    """``memagent.x.y`` -> source file."""
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def layer(module: str) -> int:
    parts = module.split(".")[1:]  # drop "memagent"
    if not parts:  # the package itself: its public names, gathered from every layer
        return LAYERS["cli"]
    if parts[-1] == "cli":
        return LAYERS["cli"]
    return LAYERS[parts[0]]


def imports(path: Path, module: str) -> set[str]:
    """memagent modules ``path`` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("memagent"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("memagent"):
                # ``from memagent.train import data`` imports the module memagent.train.data, not the package
                out.update(f"{base}.{a.name}" if (SRC.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                           or (SRC.parent / f"{base}.{a.name}".replace(".", "/")).is_dir() else base for a in node.names)
    return out


def resolve(name: str, known: dict[str, Path]) -> str:
    """The module an imported name lives in (``memagent.x.func`` -> ``memagent.x``)."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def import_violations(known: dict[str, Path]) -> list[str]:
    out = []
    for mod, path in known.items():
        for imp in sorted(imports(path, mod)):
            target = resolve(imp, known)
            if target == mod or target not in known:
                continue
            if layer(target) > layer(mod):
                out.append(f"{mod} (layer {layer(mod)}) imports {target} (layer {layer(target)})")
            if mod.startswith("memagent.rl") and not (target.startswith("memagent.rl") or target == "memagent.errors"):
                out.append(f"{mod} imports {target}: rl/ is pure tensor code")
    return out


def cycles(known: dict[str, Path]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    graph = {m: sorted({resolve(i, known) for i in imports(p, m)} & set(known) - {m}) for m, p in known.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def long_files(known: dict[str, Path]) -> list[tuple[str, int]]:
    lens = [(str(p.relative_to(SRC.parent.parent)), len(p.read_text(encoding="utf-8").splitlines())) for p in known.values()]
    return sorted([x for x in lens if x[1] > MAX_FILE_LINES], key=lambda x: -x[1])


def long_functions(known: dict[str, Path]) -> list[tuple[str, int]]:
    out = []
    for p in known.values():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append((f"{p.relative_to(SRC.parent.parent)}:{node.name}", n))
    return sorted(out, key=lambda x: -x[1])


def classes_declaring(field: str, known: dict[str, Path]) -> list[str]:
    """Classes with a class-level annotated field named ``field`` (a dataclass field)."""
    out = []
    for m, p in known.items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == field:
                        out.append(f"{m}.{node.name}")
    return out


def main() -> int:
    known = modules()
    largest = max((len(p.read_text(encoding="utf-8").splitlines()), str(p.relative_to(SRC.parent.parent))) for p in known.values())
    bad_imports, loops = import_violations(known), cycles(known)
    files, funcs = long_files(known), long_functions(known)
    chunk = classes_declaring("chunk_tokens", known)
    print(f"modules: {len(known)}; largest file: {largest[1]} ({largest[0]} lines)")
    print(f"files over {MAX_FILE_LINES} lines: {len(files)} {files}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(funcs)} {funcs}")
    print(f"imports from a higher layer: {len(bad_imports)}")
    for v in bad_imports:
        print(f"  {v}")
    print(f"import cycles: {len(loops)} {loops}")
    print(f"classes declaring chunk_tokens: {len(chunk)} {chunk}")
    ok = not (files or funcs or bad_imports or loops) and len(chunk) == 1
    print("architecture: ok" if ok else "architecture: violations")
    return 0 if ok else 1


if __name__ == "__main__":
    import argparse

    # no options: parsed so that --help shows the docstring and a mistyped flag is an error, not a silent run
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
