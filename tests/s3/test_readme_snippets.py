"""Every ```python block of README.md runs as it is (the job snippet once used ``rank``,
``state`` and ``gather`` undefined, and gathering ``rec.to_json()`` as its comment said broke
``commit_step``).

Each block runs in its own Python process (the test's interpreter and environment), in a fresh
temporary directory, with its placeholders substituted: ``/nvme/`` and ``/shared/`` become
directories under that temporary directory and ``s3://bucket/`` a fresh bucket on the session's moto
server, which ``AWS_ENDPOINT_URL`` names (with dummy credentials). torchrun's variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...) describe a world of one process. Fence info:

- ```python twice: run twice in the same directories and bucket (the second run takes the resume
  path), one run after the other in the same process (``runpy``: torch is imported once);
- ```python no-run: not run; its first line must be ``# not run: REASON`` (keep these rare).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import s3_infra
from spawn import child_env, free_port, python_cmd

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK_RE = re.compile(r"^```python([^\n]*)\n(.*?)^```$", re.S | re.M)
NO_RUN_REASON_RE = re.compile(r"# not run: \S")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence in README.md
    heading: str
    info: frozenset[str]
    code: str

    @property
    def name(self) -> str:
        return f"README.md:{self.line} ({self.heading})"


def _blocks() -> list[Block]:
    text = README.read_text(encoding="utf-8")
    out = []
    for m in BLOCK_RE.finditer(text):
        before = text[: m.start()]
        headings = re.findall(r"(?m)^#+ (.+)$", before)
        out.append(
            Block(
                before.count("\n") + 1,
                headings[-1] if headings else "top",
                frozenset(m.group(1).split()),
                m.group(2),
            )
        )
    return out


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if "no-run" not in b.info]


def test_readme_python_blocks_run_or_say_why() -> None:
    assert len(RUN) >= 4, (
        f"expected the README's Python API snippets, found {[b.name for b in BLOCKS]}"
    )
    bad = [b.name for b in BLOCKS if "no-run" in b.info and not NO_RUN_REASON_RE.match(b.code)]
    assert not bad, f"```python no-run blocks must start with '# not run: REASON': {bad}"


@pytest.mark.slow  # 1-6 s each: a fresh interpreter (torch, gloo, DCP for some)
@pytest.mark.parametrize("block", RUN, ids=[f"line{b.line}" for b in RUN])
def test_readme_snippet_runs(block: Block, tmp_path: Path, moto_server: str) -> None:
    if re.search(r"(?m)^(import torch|from torch)", block.code):
        pytest.importorskip("torch")
    loc = s3_infra.new_bucket(moto_server)
    code = (
        block.code.replace('"/nvme/', f'"{tmp_path}/nvme/')
        .replace('"/shared/', f'"{tmp_path}/shared/')
        .replace('"s3://bucket/', f'"s3://{loc.bucket}/')
    )
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    env = child_env(
        AWS_ENDPOINT_URL=moto_server,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    runs = 2 if "twice" in block.info else 1
    runner = f"import runpy, sys\nfor _ in range({runs}):\n    runpy.run_path(sys.argv[1], run_name='__main__')\n"
    r = subprocess.run(
        python_cmd("-c", runner, script),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rc = r.returncode
    assert rc == 0, (
        f"{block.name} ({runs} run(s)): exit {rc}\n"
        f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-6000:]}"
    )
