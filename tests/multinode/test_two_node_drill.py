"""The two-node drill: ``torchrun --nnodes=2 --nproc_per_node=2`` of
``tiered_ckpt.examples.train_zero`` on two "machines" (Linux namespaces, see :mod:`netns`), each
with its own disk, host name and pid space, one ``tiered-ckpt upload --watch`` sidecar per node, and
a moto S3 server both nodes reach.

Every scenario is compared with an uninterrupted two-node run (the ``reference`` fixture): after the
restart the job trains to the end and rank 0's loss for every step after the resume point equals the
reference's exactly (max |loss diff| 0.0, by the example's design).

(a) both nodes SIGKILLed mid-run, both restarted (each from its own disk);
(b) node B replaced while its upload lags: node B's sidecar is frozen (SIGSTOP) once the bucket
    holds a committed step R, node A goes on uploading its shards of newer steps that node B never confirms;
    then everything is SIGKILLed, node B's disk is deleted and the job restarts with an empty disk
    on node B: it must resume from R (node B's ranks restore it from the bucket) and train to the
    end;
(c) cluster loss: both disks deleted, both nodes restore from the bucket;
(d) (b) with the same host name on both nodes (containers often share one): nodes are told apart by
    their disks, never by host names;
(a+rollback) (a), then, once the restarted job has ended, a rollback: both nodes restarted with
    ``--resume-step R``, R the oldest step both nodes still hold: it trains R+1 to the end on the
    reference's curve, and its saves are a new attempt of the run's lineage: the bucket's record
    supersedes the first attempt's steps after R, and the final step it offers (and each node's
    disk holds) is the new attempt's save.

``tiered_ckpt.examples.train_zero`` (the native manager) runs (d) (its SIGKILL of every rank and
restart is tests/multiproc/test_resume_drill.py's and the demo's story);
``tiered_ckpt.examples.train_fsdp2`` (FSDP2, saved through DCP into each node's own disk: every
node's root committed, :mod:`tiered_ckpt.dcp.node_roots`) runs (a+rollback), (b) and (c), each
example against its own uninterrupted run. (The native manager's cluster loss is also the demo's
story; its rollback, tests/multiproc/test_resume_drill.py's.)

After each, the final step must also reach the bucket (both sidecars upload it and it commits
remotely). Run with ``-s`` to see the per-scenario figures. Needs root and iproute2/util-linux:
elsewhere it skips.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("torch")

from netns import Cluster, NamespacesRefused  # noqa: E402
from s3_infra import S3Location, new_bucket, sanitize_prefix  # noqa: E402
from spawn import cli_cmd, python_cmd  # noqa: E402

from tiered_ckpt.layout import step_dir_name  # noqa: E402
from tiered_ckpt.local.catalogue import committed_steps, read_manifest  # noqa: E402
from tiered_ckpt.remote.catalogue import (  # noqa: E402
    RemoteCatalogue,
    read_catalogue,
    remote_committed_steps,
)
from tiered_ckpt.remote.handle import StoreHandle  # noqa: E402

pytestmark = pytest.mark.slow

#: room for a kill after two saves, a step node A uploads past them, a rollback past two saves
STEPS = 40
EVERY = 5
SEED = 7
SLEEP = (
    0.15  # seconds per step in the runs that get killed: time to watch and kill at the right moment
)
RUN_TIMEOUT_S = 150.0
WAIT_TIMEOUT_S = 90.0
UPLOAD_TIMEOUT_S = 45.0
#: torchrun master ports: one per start (the namespaces live for the whole module)
MASTER_PORTS = itertools.count(29400)
ERROR_RE = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b: .*")


# --- cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    try:
        Cluster.check_host()
    except NamespacesRefused as e:
        pytest.skip(f"two-node drill: {e}")
    c = Cluster(tmp_path_factory.mktemp("multinode"))
    try:
        c.up()
    except NamespacesRefused as e:
        c.down()
        pytest.skip(f"two-node drill: namespaces refused: {e}")
    except BaseException:
        c.down()
        raise
    try:
        yield c
    finally:
        c.down()


def losses(path: Path) -> dict[int, float]:
    """Rank 0's ``{step: loss}`` (a line cut by SIGKILL is skipped)."""
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out[rec["step"]] = rec["loss"]
    return out


@dataclass
class Run:
    """One start of the job: a torchrun per node (and a sidecar per node)."""

    tag: str
    loss_log: Path
    trainers: dict[str, subprocess.Popen] = field(default_factory=dict)
    sidecars: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)

    def running(self) -> bool:
        return all(p.poll() is None for p in self.trainers.values())


class Drill:
    """The job of one scenario on the cluster: fresh disks, its own bucket prefix, node host
    names."""

    def __init__(
        self,
        cluster: Cluster,
        tmp_path: Path,
        name: str,
        hostnames: tuple[str, str],
        *,
        remote: bool = True,
        example: str = "train_zero",
    ) -> None:
        self.c = cluster
        self.example = example  # the module of tiered_ckpt.examples that trains
        self.dir = tmp_path
        for node in cluster.nodes.values():
            node.power_off()
            node.replace_disk()  # a fresh cluster: empty disks
        self.hostnames = dict(zip(("a", "b"), hostnames))
        self.root = cluster.mount_point / "ckpt"  # the same path on both nodes
        self.loc: S3Location | None = (
            new_bucket(cluster.test_endpoint, prefix=f"drill/{sanitize_prefix(name)}")
            if remote
            else None
        )
        self.runs: list[Run] = []

    # --- processes

    def start(
        self, tag: str, *, sidecars: bool = True, sleep: float = SLEEP, extra: Sequence[str] = ()
    ) -> Run:
        """Boot both nodes and start the job (and the sidecars) on them; ``extra``: more arguments
        of the example."""
        run = Run(tag, self.dir / f"{tag}.loss.jsonl")
        port = next(MASTER_PORTS)
        for i, (k, node) in enumerate(self.c.nodes.items()):
            node.boot(self.hostnames[k])
            env = node.env(self.c.endpoint)
            if sidecars and self.loc is not None:
                log = self.dir / f"{tag}.sidecar_{k}.log"
                run.sidecars[k] = node.spawn(
                    [
                        *cli_cmd(),
                        "--log-level",
                        "INFO",
                        "upload",
                        "--watch",
                        "--local",
                        str(self.root),
                        "--remote",
                        self.loc.url,
                        "--endpoint-url",
                        self.c.endpoint,
                        "--path-style",
                        "--poll-interval-s",
                        "0.2",
                    ],
                    env=env,
                    log=log,
                )
                run.logs.append(log)
            argv = python_cmd(
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=2",
                f"--node_rank={i}",
                f"--master_addr={self.c.a.addr}",
                f"--master_port={port}",
                "-m",
                f"tiered_ckpt.examples.{self.example}",
                "--steps",
                str(STEPS),
                "--ckpt-every",
                str(EVERY),
                "--root",
                str(self.root),
                "--seed",
                str(SEED),
                "--loss-log",
                str(run.loss_log),
                "--sleep-per-step",
                str(sleep),
                "--batch-per-rank",
                "4",
                "--keep-last",
                "3",
            )
            if self.loc is not None:
                argv += ["--remote-url", self.loc.url, "--upload-gated"]
            argv += extra
            log = self.dir / f"{tag}.train_{k}.log"
            run.trainers[k] = node.spawn(argv, env=env, log=log)
            run.logs.append(log)
        self.runs.append(run)
        return run

    def power_off(self) -> None:
        """SIGKILL everything on both nodes (trainers, ranks, sidecars) at once."""
        for node in self.c.nodes.values():
            node.power_off()

    def errors(self, run: Run) -> str:
        """The distinct exception lines of ``run``'s logs, then the tail of each node's trainer
        log."""
        seen: list[str] = []
        tails = []
        for log in run.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            for m in ERROR_RE.finditer(text):
                line = f"[{log.name}] {m.group(0)[:400]}"
                if line not in seen and len(seen) < 16:
                    seen.append(line)
            if ".train_" in log.name:
                tails.append(f"--- {log.name} (tail) ---\n" + "\n".join(text.splitlines()[-12:]))
        return "\n".join(seen) + "\n" + "\n".join(tails)

    def finish(self, run: Run, first: int) -> dict[int, float]:
        """Wait for both trainers; assert both exit 0 having logged steps ``first``..STEPS."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for k, p in run.trainers.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.power_off()
                got = losses(run.loss_log)
                pytest.fail(
                    f"{run.tag}: node {k}'s torchrun did not finish within {RUN_TIMEOUT_S:.0f} s "
                    f"(rank 0 logged steps {min(got, default=None)}..{max(got, default=None)}); "
                    f"errors:\n{self.errors(run)}"
                )
        got = losses(run.loss_log)
        rcs = {k: p.returncode for k, p in run.trainers.items()}
        if any(rcs.values()) or sorted(got) != list(range(first, STEPS + 1)):
            self.power_off()
            pytest.fail(
                f"{run.tag}: torchrun exit codes {rcs}; rank 0 logged steps "
                f"{min(got, default=None)}..{max(got, default=None)} (expected {first}..{STEPS}); "
                f"errors:\n{self.errors(run)}"
            )
        return got

    def wait_for(
        self,
        run: Run,
        what: str,
        cond: Callable[[], bool],
        timeout: float = WAIT_TIMEOUT_S,
        *,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """Poll ``cond`` while ``alive()`` (default: the job runs); fail (with the job's errors) if
        it stops being so, or ``timeout`` passes, first."""
        watched = "the job" if alive is None else "what it watches"
        alive = alive or run.running
        deadline = time.monotonic() + timeout
        while not cond():
            if not alive() or time.monotonic() > deadline:
                why = f"{watched} ended" if not alive() else f"{timeout:.0f} s passed"
                rcs = {k: p.poll() for k, p in run.trainers.items()}
                got = losses(run.loss_log)
                self.power_off()
                pytest.fail(
                    f"{run.tag}: {why} before {what} (torchrun exit codes {rcs}; rank 0 reached "
                    f"step {max(got, default=None)}; committed A {self.local('a')}, "
                    f"B {self.local('b')}; remote {self.remote()}); errors:\n{self.errors(run)}"
                )
            time.sleep(0.1)

    # --- state

    def local(self, k: str) -> list[int]:
        """Steps committed on node ``k``'s disk."""
        try:
            return committed_steps(self.c.nodes[k].disk / "ckpt")
        except OSError:
            return []

    def remote(self) -> list[int]:
        """Steps the bucket offers as committed."""
        assert self.loc is not None
        return remote_committed_steps(self.loc.url, s3_client=self.loc.client)

    def catalogue(self) -> RemoteCatalogue:
        """One look at the bucket prefix: its lineage record and every committed save."""
        assert self.loc is not None
        with StoreHandle(self.loc.url, s3_client=self.loc.client) as store:
            return read_catalogue(store)

    def remote_keys(self, step: int) -> list[str]:
        """Every key under the prefix that belongs to ``step`` (any key naming its step
        directory)."""
        assert self.loc is not None
        out: list[str] = []
        kw = {"Bucket": self.loc.bucket, "Prefix": self.loc.prefix + "/"}
        while True:
            page = self.loc.client.list_objects_v2(**kw)
            out += [o["Key"] for o in page.get("Contents", []) if step_dir_name(step) in o["Key"]]
            if not page.get("IsTruncated"):
                return out
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def wait_uploaded(self, run: Run, step: int) -> float:
        """After the job: both sidecars commit ``step`` remotely. Returns the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + UPLOAD_TIMEOUT_S
        while step not in self.remote():
            dead = {k: p.poll() for k, p in run.sidecars.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                self.power_off()
                pytest.fail(
                    f"{run.tag}: step {step} not committed in the bucket "
                    f"({'sidecars exited: ' + str(dead) if dead else f'{UPLOAD_TIMEOUT_S:.0f} s'}); "
                    f"remote {self.remote()}; errors:\n{self.errors(run)}"
                )
            time.sleep(0.2)
        return time.monotonic() - t0


def compare(resumed: dict[int, float], reference: dict[int, float], first: int) -> float:
    assert sorted(resumed) == list(range(first, STEPS + 1)), sorted(resumed)
    return max(abs(resumed[s] - reference[s]) for s in resumed)


# --- tests


def test_the_two_nodes_are_two_machines(cluster: Cluster) -> None:
    """The harness itself: two host names, colliding pids, separate disks at one path, S3 from
    both."""
    pa, pb = cluster.probe["a"], cluster.probe["b"]
    assert (pa["host"], pb["host"]) == ("probe-a", "probe-b")
    assert pa["pid"] == pb["pid"]  # two pid spaces: the same pid on both nodes
    assert pa["s3"] is True and pb["s3"] is True, (pa, pb)
    assert pa["disk"] == pb["disk"] == ["probe"]  # each wrote into its own disk, at the same path


def _reference(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, example: str
) -> dict[int, float]:
    d = Drill(
        cluster,
        tmp_path_factory.mktemp(f"reference_{example}"),
        "reference",
        ("node-a", "node-b"),
        remote=False,
        example=example,
    )
    run = d.start("reference", sidecars=False, sleep=0.0)
    t0 = time.monotonic()
    ref = d.finish(run, 1)
    d.power_off()
    print(f"\n[two-node drill] {example} reference: {STEPS} steps in {time.monotonic() - t0:.1f} s")
    assert ref[STEPS] < ref[1]  # it learns
    return ref


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted two-node run (no bucket, no sidecars): the loss curve every scenario must
    match."""
    return _reference(cluster, tmp_path_factory, "train_zero")


@pytest.fixture(scope="module")
def fsdp2_reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted two-node run of the FSDP2 example (DCP into node-local roots)."""
    return _reference(cluster, tmp_path_factory, "train_fsdp2")


def _after_restart(
    d: Drill,
    reference: dict[int, float],
    killed: Run,
    resume_from: int,
    label: str,
    *,
    tag: str = "resumed",
    extra: Sequence[str] = (),
) -> None:
    """Restart both nodes (the example's ``extra`` arguments), train to the end, compare with the
    reference, wait for the final upload."""
    before = losses(killed.loss_log)
    assert before and all(
        before[s] == reference[s] for s in before
    )  # determinism before the kill too
    run = d.start(tag, sleep=0.0, extra=extra)
    t0 = time.monotonic()
    got = d.finish(run, resume_from + 1)
    diff = compare(got, reference, resume_from + 1)
    up = d.wait_uploaded(run, STEPS)
    d.power_off()
    print(
        f"\n[two-node drill] {label}: resumed from step {resume_from}, steps {resume_from + 1}..{STEPS} in "
        f"{time.monotonic() - t0:.1f} s, final step in the bucket {up:.1f} s later; "
        f"max abs loss difference = {diff!r}"
    )
    assert diff == 0.0


def _sigkill_both_nodes(
    cluster: Cluster, reference: dict[int, float], tmp_path: Path, example: str
) -> Drill:
    """(a): returns the drill, both nodes powered off after the resumed run's final upload."""
    d = Drill(cluster, tmp_path, f"a-sigkill-{example}", ("node-a", "node-b"), example=example)
    run = d.start("killed")
    kill_at = 2 * EVERY + 3
    d.wait_for(
        run,
        f"two committed steps on both nodes and step {kill_at}",
        lambda: (
            len(d.local("a")) >= 2
            and len(d.local("b")) >= 2
            and max(losses(run.loss_log), default=0) >= kill_at
        ),
    )
    d.power_off()
    remote = set(d.remote())
    offers = [set(d.local(k)) | remote for k in ("a", "b")]
    resume_from = max(offers[0] & offers[1])
    print(
        f"\n[two-node drill] (a) killed after step {max(losses(run.loss_log))}: committed A {d.local('a')}, "
        f"B {d.local('b')}, remote {sorted(remote)}"
    )
    _after_restart(d, reference, run, resume_from, f"(a) SIGKILL both nodes, {example}")
    return d


def _replace_lagging_node_b(
    cluster: Cluster,
    reference: dict[int, float],
    tmp_path: Path,
    hostnames: tuple[str, str],
    label: str,
    example: str = "train_zero",
) -> None:
    d = Drill(cluster, tmp_path, label, hostnames, example=example)
    run = d.start("lagging")
    d.wait_for(
        run,
        f"step {2 * EVERY} committed in the bucket",
        lambda: max(d.remote(), default=0) >= 2 * EVERY,
    )
    sidecar_b = cluster.b.real_pid(run.sidecars["b"])
    os.kill(sidecar_b, signal.SIGSTOP)  # node B's upload lags from now on
    frozen_at = max(d.remote())

    def a_is_ahead() -> bool:
        """Node A (and B) committed a step S >= R + EVERY locally, node A's sidecar has put objects
        of S into the bucket, and S is not remotely committed (node B never confirms it)."""
        r = max(d.remote(), default=0)
        ahead = [
            s for s in d.local("a") if s >= r + EVERY and s in d.local("b") and d.remote_keys(s)
        ]
        return bool(ahead)

    # node A's sidecar may still be uploading after the job's last step: that is a moment to kill
    # too
    d.wait_for(
        run,
        "node A uploaded a step node B has not confirmed (node A's sidecar ended)",
        a_is_ahead,
        alive=lambda: run.sidecars["a"].poll() is None,
    )
    d.power_off()
    remote = d.remote()
    resume_from = max(remote)
    lagging = [s for s in d.local("a") if s > resume_from]
    print(
        f"\n[two-node drill] {label}: node B's sidecar frozen at remote step {frozen_at}; killed after step "
        f"{max(losses(run.loss_log))}: committed A {d.local('a')}, B {d.local('b')}, remote {remote}; "
        f"node A's shards of {[s for s in lagging if d.remote_keys(s)]} in the bucket, not committed"
    )
    assert lagging and all(s not in remote for s in lagging)
    cluster.b.replace_disk()  # node B is replaced: a new machine with an empty disk
    _after_restart(d, reference, run, resume_from, label)


def _cluster_loss(
    cluster: Cluster, reference: dict[int, float], tmp_path: Path, example: str
) -> None:
    d = Drill(cluster, tmp_path, f"c-cluster-loss-{example}", ("node-a", "node-b"), example=example)
    run = d.start("lost")
    d.wait_for(
        run,
        f"two steps (the newest >= {2 * EVERY}) committed in the bucket",
        lambda: len(r := d.remote()) >= 2 and r[-1] >= 2 * EVERY,
    )
    d.power_off()
    remote = d.remote()
    print(
        f"\n[two-node drill] (c) killed after step {max(losses(run.loss_log))}: committed A {d.local('a')}, "
        f"B {d.local('b')}, remote {remote}; both disks deleted"
    )
    for node in cluster.nodes.values():
        node.replace_disk()
    _after_restart(d, reference, run, max(remote), f"(c) cluster loss, {example}")


def test_d_replace_lagging_node_b_with_equal_host_names(
    cluster: Cluster, reference: dict[int, float], tmp_path: Path
) -> None:
    _replace_lagging_node_b(
        cluster,
        reference,
        tmp_path,
        ("node", "node"),
        "(d) replace lagging node B, equal host names",
    )


# --- the FSDP2 example: DCP saves into node-local roots (tiered_ckpt.dcp.node_roots), one root per
# node; node B's replacement restores only node B's ranks (its shards and the step's DCP metadata)
# from the bucket.


def test_fsdp2_b_replace_node_b_while_its_upload_lags(
    cluster: Cluster, fsdp2_reference: dict[int, float], tmp_path: Path
) -> None:
    _replace_lagging_node_b(
        cluster,
        fsdp2_reference,
        tmp_path,
        ("node-a", "node-b"),
        "(b) replace lagging node B, train_fsdp2",
        example="train_fsdp2",
    )


def test_fsdp2_c_cluster_loss_restores_from_the_bucket(
    cluster: Cluster, fsdp2_reference: dict[int, float], tmp_path: Path
) -> None:
    _cluster_loss(cluster, fsdp2_reference, tmp_path, "train_fsdp2")


def test_fsdp2_a_sigkill_both_nodes_then_restart_then_roll_back(
    cluster: Cluster, fsdp2_reference: dict[int, float], tmp_path: Path
) -> None:
    """(a), then a rollback: ``--resume-step R``, R an older step both nodes still hold (keep-last
    and upload gating kept it locally; the bucket keeps every step). The run trains R+1..STEPS on
    the reference's curve, and its saves are a new attempt: the bucket's record supersedes the
    first attempt's steps after R, and the step STEPS it offers is the new attempt's save."""
    d = _sigkill_both_nodes(cluster, fsdp2_reference, tmp_path, "train_fsdp2")
    cat = d.catalogue()
    first = cat.current_save(STEPS)
    assert first is not None and cat.lineage is not None
    remote = set(d.remote())
    local = set(d.local("a")) & set(d.local("b"))
    back_to = min(local)  # the oldest step both nodes still hold: the longest rollback they allow
    assert back_to <= STEPS - 2 * EVERY and back_to in remote, (sorted(local), sorted(remote))
    resumed = d.runs[-1]
    _after_restart(
        d,
        fsdp2_reference,
        resumed,
        back_to,
        f"(a) then a rollback to step {back_to}, train_fsdp2",
        tag="rolled_back",
        extra=("--resume-step", str(back_to)),
    )
    cat = d.catalogue()
    new = cat.current_save(STEPS)
    assert new is not None and cat.lineage is not None
    print(
        f"[two-node drill] rollback: step {STEPS} was save {first.save_id} (attempt "
        f"{first.attempt}), is save {new.save_id} (attempt {new.attempt}); remote {d.remote()}"
    )
    assert (new.run_id, new.attempt) == (first.run_id, cat.lineage.attempt)
    assert new.attempt > first.attempt and new.save_id != first.save_id
    sup = cat.lineage.superseded_by(first.attempt, STEPS)
    assert sup is not None and (sup.attempt, sup.from_step) == (new.attempt, back_to + 1)
    assert cat.status(next(s for s in cat.saves if s.save_id == first.save_id)).startswith(
        "superseded"
    )
    for k in ("a", "b"):  # each node's newest step is the new attempt's save
        m = read_manifest(d.c.nodes[k].disk / "ckpt", STEPS)
        assert (m.step, m.attempt, m.save_id) == (STEPS, new.attempt, new.save_id), k
