"""The package's house rules (docs/ARCHITECTURE.md), checked on the source with ``ast``:

- layers import only downward (base -> format -> primitives -> local -> remote -> training (with
  dcp) -> face -> front);
- no import of another folder's ``_private`` names or modules, no import circle;
- the durable-commit calls (``os.fsync``, ``os.replace``, ``os.rename``, ``os.link``,
  ``Path.rename``) only in the local commit protocol module and the one trash helper; boto3/botocore
  only in ``store/client.py`` (type-only imports aside), tenacity only in ``retry.py``; the format
  layer does no I/O and starts no threads; nothing above ``store/`` touches a boto3 client;
- inside ``remote/``, the folders by direction import one way: shared modules <- ``upload/``,
  ``restore/`` (never each other) <- ``inspect/``.

Each checker is a function of ``{module name: source}`` so that the tests below also prove, on small
made-up packages, that it catches what it is meant to catch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "tiered_ckpt"

#: Layer of each module, by longest matching prefix. Higher may import lower or equal, never higher.
LAYERS: list[tuple[str, int, str]] = [
    ("tiered_ckpt.errors", 0, "base"),
    ("tiered_ckpt.layout", 0, "base"),
    ("tiered_ckpt.state", 0, "base"),
    ("tiered_ckpt.redact", 0, "base"),
    ("tiered_ckpt.access", 0, "base"),
    ("tiered_ckpt.format", 1, "format"),
    ("tiered_ckpt.fs", 2, "primitives"),
    ("tiered_ckpt.safe_read", 2, "primitives"),
    ("tiered_ckpt.locks", 2, "primitives"),
    ("tiered_ckpt.retry", 2, "primitives"),
    ("tiered_ckpt.store", 2, "primitives"),
    ("tiered_ckpt.local", 3, "local"),
    ("tiered_ckpt.remote", 4, "remote"),
    ("tiered_ckpt.training", 5, "training"),
    ("tiered_ckpt.torch", 5, "training"),
    ("tiered_ckpt.data", 5, "training"),
    ("tiered_ckpt.dcp", 5, "training"),
    ("tiered_ckpt", 6, "face"),  # the package's __init__: the public API
    ("tiered_ckpt.cli", 7, "front"),
    ("tiered_ckpt.examples", 7, "front"),
    ("tiered_ckpt.integrations", 7, "front"),
]

DURABLE_CALLS = {"fsync", "fdatasync", "replace", "rename", "link"}
#: ``pathlib`` methods that rename or link (``Path.replace`` is left out: ``str.replace`` shares its
#: name).
DURABLE_METHODS = {"rename", "hardlink_to", "link_to"}
DURABLE_MODULES = {"tiered_ckpt.local.commit", "tiered_ckpt.local.trash"}


def package_sources(pkg: Path = PKG) -> dict[str, str]:
    out = {}
    for p in sorted(pkg.rglob("*.py")):
        rel = p.relative_to(pkg.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p.read_text()
    return out


def layer_of(mod: str) -> tuple[int, str]:
    best = max(
        (p for p in LAYERS if mod == p[0] or mod.startswith(p[0] + ".")), key=lambda p: len(p[0])
    )
    return best[1], best[2]


def folder_of(mod: str, modules: dict[str, str]) -> str:
    """The folder (package) a module's file lies in: a package's __init__ lies in its own folder."""
    if any(m.startswith(mod + ".") for m in modules):
        return mod
    return mod.rpartition(".")[0]


def imports_of(mod: str, src: str, modules: dict[str, str]) -> list[tuple[str, str | None, int]]:
    """``(target module, imported name or None, line)`` of every import in ``src``, function-level
    ones included; relative imports resolved; ``from pkg import sub`` resolved to the submodule."""
    is_pkg = any(m.startswith(mod + ".") for m in modules)
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out += [
                (a.name, None, node.lineno)
                for a in node.names
                if a.name.split(".")[0] == "tiered_ckpt"
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "tiered_ckpt":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append(
                    (sub, None, node.lineno) if sub in modules else (target, a.name, node.lineno)
                )
    return out


def check_layers(modules: dict[str, str]) -> list[str]:
    bad = []
    for mod, src in modules.items():
        lm, ln = layer_of(mod)
        for target, _, line in imports_of(mod, src, modules):
            lt, tn = layer_of(target)
            if lt > lm:
                bad.append(f"{mod}:{line} ({ln}) imports {target} ({tn}): upward")
    return bad


#: The folders of ``remote/`` by direction, with their rank: a module imports only from a lower rank
#: or its own folder (shared top-level modules: 0; ``upload/`` and ``restore/`` never import each
#: other; ``inspect/`` reads with both).
REMOTE_FOLDERS = {
    "tiered_ckpt.remote.upload": 1,
    "tiered_ckpt.remote.restore": 1,
    "tiered_ckpt.remote.inspect": 2,
}


def _remote_folder(mod: str) -> tuple[str, int] | None:
    for folder, rank in REMOTE_FOLDERS.items():
        if mod == folder or mod.startswith(folder + "."):
            return folder, rank
    if mod == "tiered_ckpt.remote" or mod.startswith("tiered_ckpt.remote."):
        return "tiered_ckpt.remote", 0
    return None


def check_remote_folders(modules: dict[str, str]) -> list[str]:
    bad = []
    for mod, src in modules.items():
        here = _remote_folder(mod)
        if here is None:
            continue
        for target, _, line in imports_of(mod, src, modules):
            there = _remote_folder(target)
            if there is not None and there[0] != here[0] and there[1] >= here[1]:
                bad.append(f"{mod}:{line} imports {target}: {here[0]} may not import {there[0]}")
    return bad


def check_private(modules: dict[str, str]) -> list[str]:
    bad = []
    for mod, src in modules.items():
        here = folder_of(mod, modules)
        for target, name, line in imports_of(mod, src, modules):
            there = folder_of(target, modules) if name is not None else target.rpartition(".")[0]
            leaf = name if name is not None else target.rpartition(".")[2]
            if leaf.startswith("_") and not leaf.startswith("__") and there != here:
                bad.append(f"{mod}:{line} imports {leaf} of {target}, private to {there}")
        bad += _private_attributes(mod, src, modules, here)
    return bad


def _private_attributes(mod: str, src: str, modules: dict[str, str], here: str) -> list[str]:
    """``alias._name`` where ``alias`` is a module of another folder imported under that name."""
    tree = ast.parse(src)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            aliases.update(
                {
                    a.asname or a.name: f"{node.module}.{a.name}"
                    for a in node.names
                    if f"{node.module}.{a.name}" in modules
                }
            )
    bad = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            target = aliases[node.value.id]
            if folder_of(target, modules) != here:
                bad.append(
                    f"{mod}:{node.lineno} uses {node.attr} of {target}, private to {folder_of(target, modules)}"
                )
    return bad


def check_circles(modules: dict[str, str]) -> list[str]:
    graph = {
        m: sorted({t for t, _, _ in imports_of(m, s, modules) if t in modules and t != m})
        for m, s in modules.items()
    }
    # A submodule import also runs its package's __init__: a package importing its own submodule and
    # the submodule importing the package is a circle; a submodule importing a sibling is not.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[str] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(" <-> ".join(sorted(comp)))

    for m in graph:
        if m not in index:
            visit(m)
    return circles


def check_durable_calls(modules: dict[str, str]) -> list[str]:
    bad: list[tuple[int, str]] = []
    for mod, src in modules.items():
        if mod in DURABLE_MODULES:
            continue
        tree = ast.parse(src)
        from_os = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module == "os"
            for a in n.names
            if a.name in DURABLE_CALLS
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in DURABLE_CALLS
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            ):
                bad.append((node.lineno, f"{mod}:{node.lineno} os.{node.attr}"))
            if isinstance(node, ast.Name) and node.id in from_os:
                bad.append((node.lineno, f"{mod}:{node.lineno} {node.id} (from os)"))
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in DURABLE_METHODS
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "os")
            ):
                bad.append((node.lineno, f"{mod}:{node.lineno} .{node.func.attr}()"))
    return [msg for _, msg in sorted(bad, key=lambda b: (b[1].split(":")[0], b[0]))]


#: The only modules that may import each library when the program runs (type-only imports under
#: ``if TYPE_CHECKING:`` are free inside ``store/``).
THIRD_PARTY_HOMES = {
    "boto3": {"tiered_ckpt.store.client"},
    "botocore": {"tiered_ckpt.store.client"},
    "tenacity": {"tiered_ckpt.retry"},
}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def check_third_party(modules: dict[str, str]) -> list[str]:
    bad = []
    for mod, src in modules.items():
        tree = ast.parse(src)
        typing_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                homes = THIRD_PARTY_HOMES.get(name.split(".")[0])
                if homes is None or mod in homes:
                    continue
                if id(node) in typing_only and mod.startswith("tiered_ckpt.store."):
                    continue
                bad.append(
                    f"{mod}:{node.lineno} imports {name} (only {', '.join(sorted(homes))} may)"
                )
    return bad


def check_format_pure(modules: dict[str, str]) -> list[str]:
    banned = {
        "os",
        "io",
        "pathlib",
        "socket",
        "threading",
        "concurrent",
        "subprocess",
        "shutil",
        "tempfile",
        "boto3",
        "botocore",
    }
    bad = []
    for mod, src in modules.items():
        if layer_of(mod)[1] != "format":
            continue
        for node in ast.walk(ast.parse(src)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [f"{mod}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in banned]
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "open"
            ):
                bad.append(f"{mod}:{node.lineno} calls open()")
    return bad


def check_no_client_above_store(modules: dict[str, str]) -> list[str]:
    """Nothing above ``store/`` reaches the boto3 client a store holds (``x.client`` /
    ``x._client``)."""
    bad = []
    for mod, src in modules.items():
        if layer_of(mod)[0] <= 2:
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Attribute) and node.attr in ("client", "_client"):
                bad.append(f"{mod}:{node.lineno} .{node.attr}")
    return bad


CHECKS = [
    check_layers,
    check_remote_folders,
    check_private,
    check_circles,
    check_durable_calls,
    check_third_party,
    check_format_pure,
    check_no_client_above_store,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_package_obeys(check) -> None:  # type: ignore[no-untyped-def]
    assert check(package_sources()) == []


def test_every_module_has_a_layer() -> None:
    for mod in package_sources():
        layer_of(mod)  # raises ValueError (max of nothing) for a module outside the map


# --- the checkers catch what they should


def _fake(**mods: str) -> dict[str, str]:
    return {k.replace("__", "."): v for k, v in mods.items()}


def test_upward_import_is_caught() -> None:
    mods = _fake(
        tiered_ckpt__local__a="from tiered_ckpt.remote.b import x\n",
        tiered_ckpt__remote__b="x = 1\n",
        tiered_ckpt__local="",
        tiered_ckpt__remote="",
    )
    assert check_layers(mods) == [
        "tiered_ckpt.local.a:1 (local) imports tiered_ckpt.remote.b (remote): upward"
    ]
    lazy = _fake(
        tiered_ckpt__format__m="def f():\n    from tiered_ckpt.local import y\n",
        tiered_ckpt__local="y = 1\n",
        tiered_ckpt__format="",
    )
    assert len(check_layers(lazy)) == 1  # function-level imports count too


def test_private_name_across_folders_is_caught() -> None:
    mods = _fake(
        tiered_ckpt__remote__r="from tiered_ckpt.local.steps import _pick\nfrom tiered_ckpt.remote.s import _ok\n",
        tiered_ckpt__remote__s="_ok = 1\n",
        tiered_ckpt__local__steps="_pick = 1\n",
        tiered_ckpt__local="",
        tiered_ckpt__remote="",
    )
    assert check_private(mods) == [
        "tiered_ckpt.remote.r:1 imports _pick of tiered_ckpt.local.steps, private to "
        "tiered_ckpt.local"
    ]
    rel = _fake(
        tiered_ckpt__cli__c="from .. import _fs\n",
        tiered_ckpt___fs="",
        tiered_ckpt__cli="",
        tiered_ckpt="",
    )
    assert (
        len(check_private(rel)) == 1
    )  # a private module of another folder, through a relative import
    attr = _fake(
        tiered_ckpt__remote__r="from tiered_ckpt.local import steps as L\nL._claim()\nL.ok()\n",
        tiered_ckpt__local__steps="",
        tiered_ckpt__local="",
        tiered_ckpt__remote="",
    )
    assert check_private(attr) == [
        "tiered_ckpt.remote.r:2 uses _claim of tiered_ckpt.local.steps, private to "
        "tiered_ckpt.local"
    ]


def test_import_between_remote_folders_is_caught() -> None:
    mods = _fake(
        tiered_ckpt__remote__upload__a="from tiered_ckpt.remote.restore.b import x\n",
        tiered_ckpt__remote__restore__b="from tiered_ckpt.remote.catalogue import y\nx = 1\n",
        tiered_ckpt__remote__inspect__c="from tiered_ckpt.remote.upload.a import z\n",
        tiered_ckpt__remote__catalogue="from tiered_ckpt.remote.inspect.c import w\ny = 1\n",
    )
    assert check_remote_folders(mods) == [
        "tiered_ckpt.remote.upload.a:1 imports tiered_ckpt.remote.restore.b: "
        "tiered_ckpt.remote.upload may not import tiered_ckpt.remote.restore",
        "tiered_ckpt.remote.catalogue:1 imports tiered_ckpt.remote.inspect.c: "
        "tiered_ckpt.remote may not import tiered_ckpt.remote.inspect",
    ]


def test_circle_is_caught() -> None:
    mods = _fake(
        tiered_ckpt__local__a="import tiered_ckpt.local.b\n",
        tiered_ckpt__local__b="def f():\n    from tiered_ckpt.local.a import g\n",
        tiered_ckpt__local="",
        tiered_ckpt="",
    )
    assert check_circles(mods) == ["tiered_ckpt.local.a <-> tiered_ckpt.local.b"]
    face = _fake(
        tiered_ckpt__local="from tiered_ckpt.local.a import x\n",
        tiered_ckpt__local__a="from tiered_ckpt.local import y\nx = 1\n",
        tiered_ckpt="",
    )
    assert check_circles(face) == ["tiered_ckpt.local <-> tiered_ckpt.local.a"]


def test_durable_calls_outside_the_protocol_are_caught() -> None:
    src = (
        "import os\nfrom os import replace as r\nos.fsync(1)\nos.rename('a', 'b')\nr('a', 'b')\n"
        "Path('a').rename('b')\nos.link('a', 'b')\n'x'.replace('x', 'y')\n"
    )
    assert check_durable_calls(
        {"tiered_ckpt.remote.restore.restorer": src, "tiered_ckpt.local.commit": src}
    ) == [
        "tiered_ckpt.remote.restore.restorer:3 os.fsync",
        "tiered_ckpt.remote.restore.restorer:4 os.rename",
        "tiered_ckpt.remote.restore.restorer:5 r (from os)",
        "tiered_ckpt.remote.restore.restorer:6 .rename()",
        "tiered_ckpt.remote.restore.restorer:7 os.link",
    ]


def test_third_party_and_purity_and_client_are_caught() -> None:
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from botocore.client import BaseClient\n"
    assert check_third_party(
        {
            "tiered_ckpt.remote.u": "import boto3\n",
            "tiered_ckpt.store.client": "import boto3\n",
            "tiered_ckpt.store.s3": "import botocore\n",
            "tiered_ckpt.store.objects": typed,
            "tiered_ckpt.remote.v": typed,
            "tiered_ckpt.local.x": "from tenacity import retry\n",
        }
    ) == [
        "tiered_ckpt.remote.u:1 imports boto3 (only tiered_ckpt.store.client may)",
        "tiered_ckpt.store.s3:1 imports botocore (only tiered_ckpt.store.client may)",
        "tiered_ckpt.remote.v:3 imports botocore.client (only tiered_ckpt.store.client may)",
        "tiered_ckpt.local.x:1 imports tenacity (only tiered_ckpt.retry may)",
    ]
    assert check_format_pure(
        {"tiered_ckpt.format.m": "import os\nopen('x')\n", "tiered_ckpt.local.m": "import os\n"}
    ) == ["tiered_ckpt.format.m:1 imports os", "tiered_ckpt.format.m:2 calls open()"]
    assert check_no_client_above_store(
        {
            "tiered_ckpt.remote.t": "store.client.put_object()\n",
            "tiered_ckpt.store.s3": "self._client.put_object()\n",
        }
    ) == ["tiered_ckpt.remote.t:1 .client"]
