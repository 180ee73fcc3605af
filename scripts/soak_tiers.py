"""Soak test of tiered checkpointing under faults (issue 31): a training job on 2 torchrun
"nodes" x 2 ranks saves every few tenths of a second to a node-local first tier with peer
replicas (each node's disk a real, small tmpfs) and promotes to S3 (moto, behind the fault
proxy), while faults drawn from a seed hit it again and again:

  s3_503        S3 answers 503 SlowDown to everything for a few seconds
  s3_stall      every S3 request takes 1-3 s longer for a few seconds
  store_reset   one rank's idle connections to the c10d store are reset (what a middlebox that
                forgets idle connections does; ``ss -K``): its tier threads reconnect
  store_reset_all   all of one rank's connections to the store are reset: its tier threads
                reconnect; its save coordinator gives up (by design: "restart the job"), and
                the job, if it ends, is relaunched (so may a ``store_reset`` end it, when the
                save's own connection was idle long enough to be among those reset)
  disk_full     a node's disk is filled to the last byte for a few seconds (saves fail meanwhile)
  kill_rank     SIGKILL of one rank: the job ends, and is relaunched
  kill_node     SIGKILL of a node's two ranks and its agent: the job ends, and is relaunched
  corrupt_local a flipped header bit in a node's copy of the newest step (before a relaunch)
  corrupt_replica   the same in a replica a node holds
  lose_node     a node's disk wiped (a replaced node, before a relaunch)

Checked after every relaunch: every rank resumes the same step, bitwise what that step saved,
and that step is the newest one whole on the copies that exist (the harness's own account of
which copies it damaged or wiped: ``expected_resume``). Checked all along: nothing committed
on S3 changes, S3's newest committed step never goes back, each node's disk holds a bounded
number of steps and replicas, the c10d store a bounded number of keys, and no tier thread of
any rank is dead (``Checkpointer.health``) while saves go on. At the end the job stops, closes
(promoting its newest step) and one more relaunch checks the resume.

    python scripts/soak_tiers.py --minutes 10 --seed 1
    python scripts/soak_tiers.py --minutes 0.8 --seed 7   # the suite's version (tests/test_soak_tiers.py)

It prints the counts (faults by kind, relaunches, saves, steps committed per tier, max store
keys, max disk use) and, on a failure, the seed that reproduces it; exits 1 then. Needs root
(tmpfs mounts, ``ss -K``); the rank processes are ``tests/tier_node_workers.py``'s ``soak``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, HERE)
sys.path.insert(0, TESTS)

from bench_s3 import start_moto  # noqa: E402
from s3_fault_proxy import FaultProxy  # noqa: E402
from tier_node_workers import Job  # noqa: E402

DISK = "40m"  # each node's first tier
MAX_STEPS_ON_A_NODE = 7  # KeepLast(2), two pinned for promotion, a partial or two, a step being pruned
MAX_STORE_KEYS = 200  # torchrun's and the save's own keys, and every tier stream's open messages
REPLICAS = ".ckptctl-replicas"
WORKER = {"keep_local": 2, "every": 20, "own_mb": 1, "pause_s": 0.15, "timeout_s": 20, "liveness_s": 6,
          "promote_timeout_s": 30}


class SoakFailure(AssertionError):
    pass


def shard(rank: int) -> str:
    return f"rank-{rank:05d}-of-00004.safetensors"


def step_of(name: str) -> int | None:
    m = re.fullmatch(r"step-(\d{10})", name)
    return int(m.group(1)) if m else None


def node_steps(root: str) -> dict[int, str]:
    """Steps committed on one node's own step directories: step -> directory."""
    if not os.path.isdir(root):
        return {}
    return {s: os.path.join(root, n) for n in os.listdir(root) if (s := step_of(n)) is not None
            and os.path.exists(os.path.join(root, n, "COMMITTED"))}


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.seed = args, args.seed
        self.rng = random.Random(args.seed)
        self.work = args.work or tempfile.mkdtemp(prefix="ckptctl-soak-")
        self.roots = [os.path.join(self.work, f"node{n}") for n in (0, 1)]
        self.faults: Counter[str] = Counter()
        self.relaunches = 0
        self.connections_reset = 0
        self.ended_by_store = 0  # jobs a store fault ended (their save coordinator gave up)
        self.full_until = 0.0  # time.monotonic() when the last disk_full fault ended
        self.saves = Counter()
        self.committed: dict[str, set[int]] = {"node0": set(), "node1": set(), "s3": set()}
        self.max_keys = 0
        self.max_disk = 0
        self.damaged: dict[str, tuple[int, int]] = {}  # copies this harness damaged: path -> (inode, mtime)
        self.s3_seen: dict[int, str] = {}  # committed S3 step -> digest of its manifest and marker
        self.job: Job | None = None
        self.launch_no = 0

    # --- set-up and tear-down -------------------------------------------------------------------

    def start(self) -> None:
        for root in self.roots:
            os.makedirs(root, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", root], check=True)
        self.moto, endpoint = start_moto()
        self.endpoint = endpoint
        self.proxy = FaultProxy(endpoint).start()
        import boto3

        self.bucket = f"soak-{self.seed}-{os.getpid()}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=self.bucket)
        self.s3_url = f"s3://{self.bucket}/run"
        os.environ["AWS_ENDPOINT_URL"] = endpoint  # the harness's own reads: never through the proxy

    def stop(self) -> None:
        if self.job is not None:
            self.job.kill()
        self.proxy.stop()
        self.moto.kill()
        for root in self.roots:
            if self.args.keep:  # the disks are tmpfs: what they held goes with the mount
                shutil.copytree(root, root + ".kept", symlinks=True, dirs_exist_ok=True)
            subprocess.run(["umount", root], check=False)
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    # --- one launch -------------------------------------------------------------------------------

    def launch(self, stop_at: int | None = None) -> Job:
        """A new job; with ``stop_at``, it stops at that step (right after its resume, when
        it is the step it resumes) and closes."""
        self.launch_no += 1
        out = os.path.join(self.work, f"run{self.launch_no}")
        if stop_at is not None:
            os.makedirs(out)
            with open(os.path.join(out, "stop_at"), "w") as f:
                f.write(str(stop_at))
        env = {"AWS_ENDPOINT_URL": self.proxy.url, "AWS_MAX_ATTEMPTS": "2"}
        job = Job("soak", [{**WORKER, "local": r, "remote": self.s3_url} for r in self.roots], out, env=env)
        self.job = job
        return job

    def loaded(self, job: Job, expected: int | None, limit_s: float = 240) -> int | None:
        """Wait for every rank's ``load_latest``; check the resume."""
        deadline = time.monotonic() + limit_s
        while True:
            got = job.results("loaded")
            if all("missing" not in g for g in got.values()):
                break
            ended = job.results()
            if any("error" in r for r in ended.values()) or time.monotonic() > deadline:
                raise SoakFailure(f"launch {self.launch_no}: the ranks did not all resume: {ended}\n{job.logs()}")
            time.sleep(0.2)
        steps = {g["step"] for g in got.values()}
        if len(steps) != 1 or not all(g["bitwise_equal"] or g["step"] is None for g in got.values()):
            raise SoakFailure(f"launch {self.launch_no}: resumed {got}")
        (step,) = steps
        if step != expected:
            raise SoakFailure(f"launch {self.launch_no}: resumed step {step}, but the newest step whole on the "
                              f"copies that exist is {expected}\n{job.logs()}")
        return step

    def progress(self, job: Job) -> int:
        """The ranks' newest step; raises on a dead tier thread or one retrying for long."""
        newest = 0
        for r, p in job.results("progress").items():
            if "missing" in p:
                continue
            newest = max(newest, p["step"])
            for text, dead, for_s in p["troubles"]:
                if dead or for_s > 60:
                    raise SoakFailure(f"rank {r}: a tier thread is not doing its work while saves go on: {text}")
        return newest

    def watch(self, job: Job) -> None:
        """The invariants that hold all along."""
        self.max_keys = max(self.max_keys, self.store_keys(job))
        if self.max_keys > MAX_STORE_KEYS:
            raise SoakFailure(f"the c10d store holds {self.max_keys} keys")
        for n, root in enumerate(self.roots):
            used = shutil.disk_usage(root).used
            self.max_disk = max(self.max_disk, used)
            steps = [e for e in os.listdir(root) if step_of(e) is not None]
            reps = os.listdir(os.path.join(root, REPLICAS)) if os.path.isdir(os.path.join(root, REPLICAS)) else []
            settled = time.monotonic() - self.full_until > 5  # the saves a full disk failed are pruned by then
            if settled and (len(steps) > MAX_STEPS_ON_A_NODE or len(reps) > MAX_STEPS_ON_A_NODE):
                raise SoakFailure(f"node {n} holds {len(steps)} steps and {len(reps)} replicas: {sorted(steps)}")
            self.committed[f"node{n}"] |= set(node_steps(root))
        self.check_s3()

    def store_keys(self, job: Job) -> int:
        import torch.distributed as dist

        try:
            if getattr(job, "counter", None) is None:
                job.counter = dist.TCPStore("127.0.0.1", job.port, is_master=False, timeout=timedelta(seconds=2))
            return job.counter.num_keys()
        except RuntimeError:
            job.counter = None
            return 0  # the job is between launches, or its store is going away

    def check_s3(self) -> None:
        from ckptctl.storage import open_storage

        root = open_storage(self.s3_url)
        now: dict[int, str] = {}
        for item in root.children():
            s = step_of(item.key)
            if s is None or root.sub(item.key).stat("COMMITTED") is None:
                continue
            d = root.sub(item.key)
            now[s] = hashlib.sha256(d.read("manifest.json") + d.read("COMMITTED")).hexdigest()
        for s, digest in now.items():
            if self.s3_seen.get(s, digest) != digest:
                raise SoakFailure(f"S3's committed step {s} changed")
        if self.s3_seen and now and max(now) < max(self.s3_seen):
            raise SoakFailure(f"S3's newest committed step went back from {max(self.s3_seen)} to {max(now)}")
        if self.s3_seen and not now:
            raise SoakFailure("every committed step on S3 is gone")
        self.s3_seen.update(now)
        self.committed["s3"] |= set(now)

    # --- faults -----------------------------------------------------------------------------------

    def fault_during(self, job: Job) -> bool:
        """One fault while the job runs; True when it may end the job (a relaunch follows)."""
        kind = self.rng.choice(["s3_503", "s3_stall", "store_reset", "store_reset", "store_reset_all", "disk_full"])
        self.faults[kind] += 1
        if kind in ("s3_503", "s3_stall"):
            lasting = self.rng.uniform(1.0, 5.0)
            stall = f"stall:{self.rng.uniform(1.0, 3.0):.1f}"
            self.proxy.rule = lambda method, path: "503" if kind == "s3_503" else stall
            self.sleep(job, lasting)
            self.proxy.rule = lambda method, path: None
        elif kind in ("store_reset", "store_reset_all"):
            rank = self.rng.randrange(4)
            idle_ms = 2000 if kind == "store_reset" else 0
            self.connections_reset += self.reset_connections(job.pid(rank), job.port, idle_ms)
            return True  # the save's own connection may be among them: the job may end
        else:
            root = self.roots[self.rng.randrange(2)]
            ballast = os.path.join(root, "ballast")
            with open(ballast, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                except OSError:
                    pass  # full
            self.full_until = float("inf")
            self.sleep(job, self.rng.uniform(1.0, 3.0))
            os.remove(ballast)
            self.full_until = time.monotonic()
        return False

    def reset_connections(self, pid: int, port: int, idle_ms: int) -> int:
        """Reset ``pid``'s connections to the store idle for ``idle_ms`` (with 2000: mostly the
        tier threads' waits; a save's connections are busy every save, the heartbeat's every
        beat). Returns how many."""
        mine = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    mine.add(target[8:-1])
        except FileNotFoundError:
            return 0  # the rank is gone
        out = subprocess.run(["ss", "-tnie", "dport", "=", f":{port}"], capture_output=True, text=True).stdout
        lines, killed = out.splitlines(), 0
        for line, info in zip(lines, lines[1:]):
            ino = re.search(r"\bino:(\d+)", line)
            local = re.search(r"\S+:(\d+)\s+\S+:" + str(port) + r"\s", line)
            idle = [int(m) for m in re.findall(r"last(?:snd|rcv):(\d+)", info)]
            if ino and ino.group(1) in mine and local and idle and min(idle) >= idle_ms:
                subprocess.run(["ss", "-K", "dport", "=", f":{port}", "sport", "=", f":{local.group(1)}"],
                               capture_output=True)
                killed += 1
        return killed

    def fault_between(self) -> None:
        """Damage done while the job is down: it must resume around it."""
        kind = self.rng.choice(["none", "corrupt_local", "corrupt_replica", "lose_node"])
        if kind == "none":
            return
        n = self.rng.randrange(2)
        root = self.roots[n]
        if kind == "lose_node":
            for e in os.listdir(root):
                p = os.path.join(root, e)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            self.damaged = {d: v for d, v in self.damaged.items() if not d.startswith(root + os.sep)}
        else:
            steps = node_steps(root)
            if not steps:
                return
            newest = os.path.join(root, os.path.basename(steps[max(steps)]))
            where = newest if kind == "corrupt_local" else os.path.join(root, REPLICAS, os.path.basename(newest))
            names = [f for f in os.listdir(where) if f.endswith(".safetensors") and not f.startswith(".")] \
                if os.path.isdir(where) else []
            if not names:
                return
            path = os.path.join(where, self.rng.choice(sorted(names)))
            with open(path, "r+b") as f:
                f.seek(40)
                b = f.read(1)
                f.seek(40)
                f.write(bytes([b[0] ^ 0x01]))
            st = os.stat(path)
            self.damaged[path] = (st.st_ino, st.st_mtime_ns)
        self.faults[kind] += 1

    # --- what a resume must find ---------------------------------------------------------------

    def expected_resume(self) -> int | None:
        """The newest step whole on the copies that exist: its manifest from a node that
        commits it or from S3, and for every file it lists: the writer's node's copy, the
        partner node's complete replica (a node commits the step, so recovery can run), or S3's
        committed copy; a copy this harness damaged counts only once replaced."""
        from ckptctl.storage import open_storage

        s3 = open_storage(self.s3_url)
        on_s3 = {s for s in map(step_of, (i.key for i in s3.children())) if s is not None
                 and s3.sub(f"step-{s:010d}").stat("COMMITTED") is not None}
        on_nodes = [node_steps(r) for r in self.roots]
        for s in sorted(on_s3 | set(on_nodes[0]) | set(on_nodes[1]), reverse=True):
            name = f"step-{s:010d}"
            if s in on_s3:
                return s  # every file checked on its way up; this harness damages no S3 object
            raw = next(open(os.path.join(n[s], "manifest.json"), "rb").read() for n in on_nodes if s in n)
            files = [(f["name"], f["rank"]) for f in json.loads(raw)["files"]]
            if all(self._intact(os.path.join(self.roots[rank // 2], name, f)) or
                   (os.path.exists(os.path.join(self.roots[1 - rank // 2], REPLICAS, name, f"rank-{rank:05d}.replica"))
                    and self._intact(os.path.join(self.roots[1 - rank // 2], REPLICAS, name, f)))
                   for f, rank in files):
                return s
        return None

    def _intact(self, path: str) -> bool:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        return self.damaged.get(path) != (st.st_ino, st.st_mtime_ns)

    # --- the run ----------------------------------------------------------------------------------

    def sleep(self, job: Job, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.watch(job)
            self.progress(job)
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def ended(self, job: Job) -> bool:
        return all(p.poll() is not None for p in job.procs)

    def run(self) -> None:
        """Launches until the time is up, each with faults for 6-15 s (less in a run under a
        minute) and then killed (at least one relaunch); then a launch that stops, closes, and
        is resumed once more."""
        deadline = time.monotonic() + 60 * self.args.minutes
        expected = None
        while True:
            job = self.launch()
            self.loaded(job, expected)
            if time.monotonic() >= deadline and self.relaunches:
                self.sleep(job, 3)
                self.finish(job)
                return
            end = time.monotonic() + self.rng.uniform(6, 15) * min(1.0, self.args.minutes)
            may_end = False
            while not (may_end and self.ended(job)):
                may_end = self.fault_during(job) or may_end
                self.sleep(job, self.rng.uniform(1.0, 3.0))
                if self.ended(job) and not may_end:
                    raise SoakFailure(f"launch {self.launch_no} ended by itself: {job.results()}\n{job.logs()}")
                if time.monotonic() >= end:
                    break
            self.proxy.rule = lambda method, path: None
            if self.ended(job):
                self.ended_by_store += 1
            else:
                kind = self.rng.choice(["kill_rank", "kill_node"])
                self.faults[kind] += 1
                n = self.rng.randrange(2)
                victims = [self.rng.randrange(4)] if kind == "kill_rank" else [2 * n, 2 * n + 1]
                for r in victims:
                    _kill(os.kill, job.pid(r))
                if kind == "kill_node":
                    _kill(os.killpg, job.procs[n].pid)
            end = time.monotonic() + 10  # the survivors see their next save fail within liveness_s
            while not self.ended(job) and time.monotonic() < end:
                time.sleep(0.2)
            self.count_saves(job)
            job.kill()
            self.watch(job)
            self.fault_between()
            expected = self.expected_resume()
            self.relaunches += 1

    def count_saves(self, job: Job) -> None:
        """This launch's saves: every rank sees each save's outcome, so the most any rank saw."""
        got = [p for p in job.results("progress").values() if "missing" not in p]
        self.saves["ok"] += max((p["ok"] for p in got), default=0)
        self.saves["failed"] += max((p["failures"] for p in got), default=0)

    def finish(self, job: Job) -> None:
        stop_at = self.progress(job) + 3
        with open(os.path.join(job.out, "stop_at.tmp"), "w") as f:
            f.write(str(stop_at))
        os.replace(os.path.join(job.out, "stop_at.tmp"), os.path.join(job.out, "stop_at"))
        results = job.wait(180)
        for r, res in results.items():
            if "error" in res or "missing" in res or "ended" in res:
                raise SoakFailure(f"rank {r} did not close cleanly: {res}\n{job.logs()}")
        flushed = results[0]["flushed"]
        if not flushed["complete"] or flushed["troubles"]:
            raise SoakFailure(f"close: {flushed}")
        self.count_saves(job)
        self.watch(job)
        expected = self.expected_resume()
        job = self.launch(stop_at=expected or 0)  # one more resume, with nothing in the way
        self.relaunches += 1
        self.loaded(job, expected)
        results = job.wait(180)
        for r, res in results.items():
            if "error" in res or "missing" in res:
                raise SoakFailure(f"rank {r} did not close after the last resume: {res}\n{job.logs()}")

    def report(self, ok: bool, why: str = "") -> None:
        lines = [
            f"soak_tiers: {'PASSED' if ok else 'FAILED'} (seed {self.seed}, {self.args.minutes:g} min)",
            f"  faults: {dict(sorted(self.faults.items()))} ({sum(self.faults.values())} in all)",
            f"  relaunches: {self.relaunches} ({self.ended_by_store} after a store fault ended the job); "
            f"store connections reset: {self.connections_reset}",
            f"  saves: {int(self.saves['ok'])} committed, {int(self.saves['failed'])} failed",
            f"  steps committed: node0 {len(self.committed['node0'])}, node1 {len(self.committed['node1'])}, "
            f"s3 {len(self.committed['s3'])}",
            f"  max store keys: {self.max_keys}; max disk use per node: {self.max_disk / (1 << 20):.1f} MiB of {DISK}",
        ]
        if not ok:
            lines.append(f"  why: {why}")
            lines.append(f"  reproduce: python scripts/soak_tiers.py --minutes {self.args.minutes:g} --seed {self.seed} "
                         f"--keep (work dir: {self.work})")
        print("\n".join(lines), flush=True)


def _kill(how, pid: int) -> None:
    try:
        how(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone (a fault before this one ended it)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to inject faults (then a clean close)")
    ap.add_argument("--seed", type=int, default=None, help="the faults' seed (default: random, printed)")
    ap.add_argument("--work", default=None, help="where the nodes' disks and the logs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    if os.geteuid() != 0:
        print("soak_tiers: needs root (tmpfs mounts for the nodes' disks, ss -K for the store faults)", file=sys.stderr)
        return 2
    soak = Soak(args)
    soak.start()
    try:
        soak.run()
    except SoakFailure as e:
        soak.args.keep = True
        soak.report(False, str(e)[:4000])
        return 1
    except Exception as e:  # the harness itself: still the counts and the seed
        soak.args.keep = True
        soak.report(False, f"the harness failed: {type(e).__name__}: {e}")
        raise
    finally:
        soak.stop()
    soak.report(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
