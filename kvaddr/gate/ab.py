"""A/B timing against a git revision: what ``kvaddr check --against REV`` runs.

REV's tree is written by ``git archive REV | tar -x`` into a temporary folder
(:func:`materialised`): the user's checkout and its ``.git`` are only read, and
the folder is removed on the way out, also on Ctrl-C and on errors. Each
workload is then profiled by both trees, interleaved round by round (in every
round REV's ``kvaddr profile ... --json -``, then the current tree's), each in a
process of its own (:class:`Side`), so that each loads its own package and
kernels. REV runs as its own command line, never through its Python API, so
two versions whose APIs differ still compare; :func:`probe` reads REV's
``kvaddr profile --help`` first, so that a REV without kvaddr, or without an
asked option, stops before any timing.

Each side's samples are pooled over the rounds (:func:`pool`) and compared by
:mod:`kvaddr.gate.comparison` like any two runs. How far the per-round medians
of one side spread (:func:`round_spreads`) is noise of the machine between
processes, which belongs to neither side.

Layer: gate (see :mod:`kvaddr.gate`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvaddr.errors import BaselineError, RevisionError, SideFailed

#: Rounds of an A/B run (docs/ci-gate.md, "Choosing --rounds", derives it).
DEFAULT_ROUNDS = 5
#: Sampling seconds per strategy and mode in each round's profile: five rounds of 0.2 s give each side the
#: samples of one default ``kvaddr profile`` (1 s).
DEFAULT_BUDGET = 0.2
#: ``kvaddr profile`` options an A/B run needs of both trees.
NEEDED_FLAGS = ("--json", "--budget", "--device")
#: The module both sides run as ``python -m``.
CLI_MODULE = "kvaddr.cli"
#: What :func:`probe` runs: where kvaddr is imported from, then ``kvaddr profile --help`` (as ``-m`` runs it).
PROBE_CODE = (
    "import runpy, sys, kvaddr; print(kvaddr.__file__, flush=True); "
    f"sys.argv = ['kvaddr', 'profile', '--help']; runpy.run_module({CLI_MODULE!r}, run_name='__main__')"
)
#: Lines of a failed process's stderr repeated in the error.
TAIL_LINES = 12


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    kept = [line for line in (text or "").strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept) if kept else "(nothing on stderr)"


# ----------------------------------------------------------------------------- the revision's tree


def _git(cwd: str, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise RevisionError("--against needs git, and no git command was found") from None


def repository_root(cwd: str | None = None) -> str:
    """The top folder of the git repository holding ``cwd`` (default: the current directory)."""
    cwd = cwd or os.getcwd()
    done = _git(cwd, "rev-parse", "--show-toplevel")
    if done.returncode != 0 or not done.stdout.strip():
        raise RevisionError(
            f"--against compares with a git revision, but {cwd} is not inside a git repository "
            f"(git: {_tail(done.stderr, 1)})"
        )
    return done.stdout.strip()


def resolve_revision(repo: str, rev: str) -> str:
    """The full commit id ``rev`` names in ``repo`` (a commit, tag, branch, ``origin/main``, ``HEAD~1``)."""
    if not rev or rev.startswith("-"):
        raise RevisionError(f"{rev!r} is not a git revision")
    done = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if done.returncode != 0 or not done.stdout.strip():
        raise RevisionError(
            f"{rev!r} names no commit of the repository {repo} (a shallow clone may lack it: fetch it, "
            f"e.g. actions/checkout with fetch-depth: 0)"
        )
    return done.stdout.strip()


def extract(repo: str, commit: str, dest: str) -> None:
    """Write ``commit``'s tree into the folder ``dest``: ``git archive commit | tar -x -C dest``."""
    try:
        archive = subprocess.Popen(
            ["git", "archive", "--format=tar", commit], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    except FileNotFoundError:
        raise RevisionError("--against needs git, and no git command was found") from None
    try:
        untar = subprocess.run(["tar", "-x", "-f", "-", "-C", dest], stdin=archive.stdout, capture_output=True)
    finally:
        archive.stdout.close()
        archive_err = archive.stderr.read().decode(errors="replace")
        archive.stderr.close()
        archive.wait()
    if archive.returncode != 0:
        raise RevisionError(f"git archive {commit[:12]} failed: {_tail(archive_err, 3)}")
    if untar.returncode != 0:
        raise RevisionError(f"unpacking {commit[:12]}'s tree failed: {_tail(untar.stderr.decode(errors='replace'), 3)}")


@dataclass(frozen=True)
class Revision:
    """A revision's tree, written out by :func:`materialised`.

    Attributes
    ----------
    rev : str
        As the user named it (``HEAD~1``).
    commit : str
        The full commit id.
    tree : str
        The folder holding its files (its import root: ``tree/kvaddr``).
    workdir : str
        An empty folder the profile processes run in (so that neither picks up a
        ``kvaddr`` from the current directory).
    """

    rev: str
    commit: str
    tree: str
    workdir: str

    @property
    def label(self) -> str:
        short = self.commit[:12]
        return short if self.commit.startswith(self.rev.lower()) else f"{self.rev} ({short})"


@contextlib.contextmanager
def materialised(rev: str, cwd: str | None = None) -> Iterator[Revision]:
    """REV's tree in a temporary folder, removed when the block ends (however it ends).

    Raises
    ------
    RevisionError
        Not in a git repository, no such revision, or no kvaddr package in it.
    """
    repo = repository_root(cwd)
    commit = resolve_revision(repo, rev)
    tmp = tempfile.mkdtemp(prefix="kvaddr-against-")
    try:
        tree, workdir = os.path.join(tmp, "tree"), os.path.join(tmp, "work")
        os.mkdir(tree)
        os.mkdir(workdir)
        extract(repo, commit, tree)
        missing = [p for p in ("kvaddr/__init__.py", "kvaddr/cli.py") if not os.path.isfile(os.path.join(tree, p))]
        if missing:
            raise RevisionError(
                f"{rev!r} ({commit[:12]}) has no kvaddr package at the top of its tree ({', '.join(missing)} "
                f"missing): nothing to time against"
            )
        yield Revision(rev, commit, tree, workdir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- the two sides


def current_import_root() -> str:
    """The folder the running kvaddr package is imported from (``<root>/kvaddr``)."""
    import kvaddr

    return os.path.dirname(os.path.dirname(os.path.abspath(kvaddr.__file__)))


@dataclass(frozen=True)
class Side:
    """One side of an A/B run: a kvaddr tree run as ``python -m kvaddr.cli`` with its own import root.

    Attributes
    ----------
    role : str
        ``"base"`` (the revision) or ``"new"`` (the running kvaddr).
    label : str
        How reports name it (``HEAD~1 (0123456789ab)``, ``this tree``).
    import_root : str
        Put first on ``PYTHONPATH``: the folder holding its ``kvaddr`` package.
    """

    role: str
    label: str
    import_root: str

    def environ(self) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([self.import_root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        return env

    def run(self, argv: Sequence[str], cwd: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *argv], cwd=cwd, env=self.environ(), capture_output=True, text=True, check=False
        )


def probe(side: Side, cwd: str) -> frozenset:
    """The options of ``side``'s ``kvaddr profile`` (from its ``--help``), checked to be usable.

    Raises
    ------
    RevisionError
        Its kvaddr does not import, is imported from elsewhere than its tree,
        has no ``python -m kvaddr.cli`` entry point, or lacks one of
        :data:`NEEDED_FLAGS`.
    """
    done = side.run(["-c", PROBE_CODE], cwd)
    if done.returncode != 0:
        raise RevisionError(
            f"{side.label}: its kvaddr cannot start (`kvaddr profile --help` exited {done.returncode}):\n"
            f"{_tail(done.stderr)}"
        )
    first, _, help_text = done.stdout.partition("\n")
    root = os.path.realpath(side.import_root) + os.sep
    if not os.path.realpath(first.strip()).startswith(root):
        raise RevisionError(
            f"{side.label}: python imported kvaddr from {first.strip()!r}, not from its tree {side.import_root!r}"
        )
    flags = help_flags(help_text)
    missing = [f for f in NEEDED_FLAGS if f not in flags]
    if missing:
        raise RevisionError(
            f"{side.label}: its `kvaddr profile` has no {', '.join(missing)} option"
            + ("" if flags else " (python -m kvaddr.cli printed no help: no command-line entry point)")
            + "; it cannot take part in an A/B run"
        )
    return flags


def help_flags(help_text: str) -> frozenset:
    """The options a click command's ``--help`` declares: the flags that start a line of its Options
    section (``  --seed N  ...``, ``  -h, --help``), not the ones its prose mentions."""
    _, _, options = help_text.partition("\nOptions:")
    out = set()
    for line in options.splitlines():
        head = re.match(r"\s{1,8}((?:-\w,\s*)?--[a-z][\w-]*(?:\s*/\s*--[a-z][\w-]*)?)", line)
        if head:
            out.update(re.findall(r"--[a-z][\w-]*", head.group(1)))
    return frozenset(out)


def side_args(side: Side, flags: frozenset, words: Sequence[tuple], droppable: frozenset = frozenset()) -> list:
    """``words`` (``(flag, text)`` pairs) as ``side``'s argument list.

    A flag ``side`` lacks is left out when it is in ``droppable`` (its value is
    what a kvaddr without the option does anyway); otherwise RevisionError
    names it.
    """
    out = []
    for option, text in words:
        if option not in flags:
            if option in droppable:
                continue
            raise RevisionError(
                f"{side.label}: its `kvaddr profile` has no {option} option (asked: {option} {text}); "
                f"it cannot profile this workload"
            )
        out += [option, text]
    return out


def profile_once(side: Side, args: Sequence[str], cwd: str) -> dict:
    """Run ``side``'s ``kvaddr profile ARGS --json -`` and return its report.

    Raises
    ------
    SideFailed
        The process failed (its exit status and stderr's last lines).
    RevisionError
        It printed something this kvaddr cannot read as a profile report.
    """
    from kvaddr.gate.baseline_file import from_document

    done = side.run(["-m", CLI_MODULE, "profile", *args, "--json", "-"], cwd)
    shown = shlex.join(["kvaddr", "profile", *args, "--json", "-"])
    if done.returncode != 0:
        raise SideFailed(f"{side.label}: `{shown}` exited {done.returncode}:\n{_tail(done.stderr)}", done.returncode)
    try:
        doc = json.loads(done.stdout)
        from_document(doc, side.label)
    except (ValueError, BaselineError) as exc:
        raise RevisionError(f"{side.label}: `{shown}` printed no report this kvaddr reads ({exc})") from None
    return doc


@dataclass
class ABRuns:
    """Every report of an A/B run.

    Attributes
    ----------
    base, new : list of list of dict
        Per workload, the reports of each round.
    rounds : int
    wall_s : float
        Seconds from the first process's start to the last one's end.
    """

    base: list
    new: list
    rounds: int
    wall_s: float


def run_ab(
    base: Side,
    new: Side,
    workloads: Sequence[tuple],
    rounds: int,
    cwd: str,
    note: Callable[[str], None] = lambda _line: None,
) -> ABRuns:
    """Profile every workload on both sides, interleaved: each round runs, per workload, base then new.

    Parameters
    ----------
    workloads : sequence of (str, list, list)
        A name for the status lines, then base's and new's argument lists.
    note : callable
        Told one status line per process.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    docs = {side.role: [[] for _ in workloads] for side in (base, new)}
    started = time.perf_counter()
    for r in range(rounds):
        for w, (name, base_args, new_args) in enumerate(workloads):
            for side, args in ((base, base_args), (new, new_args)):
                t0 = time.perf_counter()
                docs[side.role][w].append(profile_once(side, args, cwd))
                note(f"round {r + 1}/{rounds}, {name}: {side.label}: {time.perf_counter() - t0:.1f} s")
    return ABRuns(docs[base.role], docs[new.role], rounds, round(time.perf_counter() - started, 3))


# ----------------------------------------------------------------------------- pooling and spread


def _result_key(shape: dict, result: dict) -> tuple:
    return shape["batch"], result["strategy"], result["mode"], result["clock"]


def pool(docs: Sequence[dict]) -> dict:
    """One report holding every round's samples: the first round's report, each measurement's samples
    the rounds' concatenated (in round order) and its summary recomputed; ``rounds`` records how many."""
    from kvaddr.measure.timing import summarize

    if not docs:
        raise ValueError("pool needs at least one report")
    samples: dict = {}
    for doc in docs:
        for shape in doc["shapes"]:
            for result in shape["results"]:
                samples.setdefault(_result_key(shape, result), []).extend(result["samples_us"])
    out = copy.deepcopy(docs[0])
    for shape in out["shapes"]:
        for result in shape["results"]:
            result["samples_us"] = samples[_result_key(shape, result)]
            if isinstance(result.get("summary"), dict):
                result["summary"] = summarize(result["samples_us"]).as_dict()
    out["rounds"] = len(docs)
    out["wall_s"] = round(sum(float(d.get("wall_s") or 0.0) for d in docs), 3)
    return out


@dataclass(frozen=True)
class RoundSpread:
    """The per-round medians of one measurement, on each side."""

    base_medians: tuple
    new_medians: tuple

    @staticmethod
    def _spread(medians: tuple) -> float:
        lo, hi = min(medians), max(medians)
        return hi / lo if lo > 0 else float("nan")

    @property
    def base(self) -> float:
        """max / min of base's per-round medians (1.0: every round alike)."""
        return self._spread(self.base_medians)

    @property
    def new(self) -> float:
        return self._spread(self.new_medians)

    def as_dict(self) -> dict:
        def num(x: float):
            return float(f"{x:.6g}") if np.isfinite(x) else None

        return {
            "base": num(self.base),
            "new": num(self.new),
            "base_round_medians": [num(m) for m in self.base_medians],
            "new_round_medians": [num(m) for m in self.new_medians],
        }


def round_spreads(ab: ABRuns, labels: Sequence[str], relative: bool = False) -> dict:
    """``{(run label, batch, strategy, relative_to, mode, clock): RoundSpread}`` of every measurement both
    sides have (the quantities :func:`~kvaddr.gate.comparison.compare_runs` compares)."""
    from kvaddr.gate.comparison import measurement_samples

    out = {}
    for label, base_docs, new_docs in zip(labels, ab.base, ab.new):
        medians: dict = {}
        for role, docs in (("base", base_docs), ("new", new_docs)):
            for doc in docs:
                for key, samples in measurement_samples(doc, relative).items():
                    medians.setdefault(key, {"base": [], "new": []})[role].append(float(np.median(samples)))
        for key, sides in medians.items():
            if sides["base"] and sides["new"]:
                out[(label, *key)] = RoundSpread(tuple(sides["base"]), tuple(sides["new"]))
    return out
