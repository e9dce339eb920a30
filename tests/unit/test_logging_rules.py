"""Library code configures no logging: no handler, no ``basicConfig``, never the
root logger. Only the CLI's logging module (``tiered_ckpt.cli._logs``) adds a handler; a script may
configure logging inside its ``if __name__ == "__main__":`` block. Checked on the source with
``ast``."""

from __future__ import annotations

import ast

from test_architecture import package_sources

CONFIGURING_CALLS = {"basicConfig", "addHandler", "dictConfig", "fileConfig", "captureWarnings"}
#: modules allowed to configure logging (their own handler on named loggers)
ALLOWED = {"tiered_ckpt.cli._logs"}


def _main_blocks(tree: ast.Module) -> set[int]:
    """Line numbers inside ``if __name__ == "__main__":`` blocks."""
    lines: set[int] = set()
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        ):
            for sub in ast.walk(node):
                if hasattr(sub, "lineno"):
                    lines.add(sub.lineno)
    return lines


def logging_violations(sources: dict[str, str]) -> list[str]:
    out = []
    for mod, src in sources.items():
        if mod in ALLOWED:
            continue
        tree = ast.parse(src)
        main_lines = _main_blocks(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in main_lines:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                if name in CONFIGURING_CALLS:
                    out.append(f"{mod}:{node.lineno}: {name}()")
                elif name == "setLevel" and not mod.startswith("tiered_ckpt.cli"):
                    out.append(f"{mod}:{node.lineno}: setLevel()")
                elif name == "getLogger" and (
                    not node.args
                    or (
                        isinstance(node.args[0], ast.Constant)
                        and node.args[0].value in ("", "root", None)
                    )
                ):
                    out.append(f"{mod}:{node.lineno}: the root logger")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr == "root"
                and isinstance(node.value, ast.Name)
                and node.value.id == "logging"
            ):
                out.append(f"{mod}:{node.lineno}: logging.root")
    return out


def test_library_configures_no_logging() -> None:
    assert logging_violations(package_sources()) == []


def test_checker_catches_each_kind() -> None:
    bad = {
        "tiered_ckpt.remote.x": "import logging\nlogging.basicConfig(level=10)\n",
        "tiered_ckpt.store.y": "import logging\nlogging.getLogger('tiered_ckpt').addHandler(logging.StreamHandler())\n",
        "tiered_ckpt.local.z": "import logging\nlogging.getLogger().setLevel(10)\nlogging.root.info('x')\n",
        "tiered_ckpt.examples.w": "import logging\ndef main():\n    logging.basicConfig()\n",
        "tiered_ckpt.examples.ok": "import logging\nif __name__ == '__main__':\n    logging.basicConfig()\n",
        "tiered_ckpt.cli.demo_x": "import logging\nlogging.getLogger('werkzeug').setLevel(30)\n",
    }
    assert logging_violations(bad) == [
        "tiered_ckpt.remote.x:2: basicConfig()",
        "tiered_ckpt.store.y:2: addHandler()",
        "tiered_ckpt.local.z:2: setLevel()",
        "tiered_ckpt.local.z:2: the root logger",
        "tiered_ckpt.local.z:3: logging.root",
        "tiered_ckpt.examples.w:3: basicConfig()",
    ]
