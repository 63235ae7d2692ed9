"""Baseline files: reading, writing, and matching their environment and workload.

A baseline (docs/baseline-format.md) is one JSON document holding one or more
complete ``kvaddr profile`` reports ("runs"), each with its environment, its
workload, its options and every raw sample::

    {"kind": "kvaddr.baseline", "baseline_format": 1, "created_utc": ..., "updated_utc": ...,
     "runs": [<kvaddr.profile document>, ...]}

A plain ``kvaddr profile --json`` report is read as a baseline of one run.
Runs are identified by their *run key*: the workload (``model_source``
aside), the batch sizes, the modes and the device kind. Saving a run into an
existing baseline replaces the run with the same key, or adds it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from dataclasses import dataclass

from kvaddr.errors import BaselineError, BaselineMismatch, BaselineWriteError
from kvaddr.measure.report import SCHEMA_VERSION

BASELINE_KIND = "kvaddr.baseline"
BASELINE_FORMAT = 1
PROFILE_KIND = "kvaddr.profile"

#: Environment fields that identify the machine (dotted paths into ``environment``), per device kind.
MACHINE_FIELDS = {
    "cuda": ("gpu.name", "gpu.compute_capability", "gpu.multiprocessors", "driver_version", "cuda_driver"),
    "cpu": ("cpu",),
}
#: Environment fields reported when they differ, never a mismatch.
NOTE_FIELDS = (
    "gpu.total_memory_bytes",
    "cuda_runtime",
    "nvrtc",
    "cupy",
    "numpy",
    "python",
    "platform",
    "kvaddr",
    "git_commit",
    "git_dirty",
)
#: Workload fields that do not change what is measured.
WORKLOAD_IGNORED = ("model_source",)
#: How a null workload field reads (the others: "none").
NO_VALUE = {
    "workload.prefill": "none (no chunked-prefill requests)",
    "workload.spec_tokens": "none (no speculative tokens)",
}


@dataclass(frozen=True)
class Baseline:
    """A baseline file (or a profile report read as one).

    Attributes
    ----------
    path : str
    kind : str
        ``"kvaddr.baseline"`` or ``"kvaddr.profile"``.
    runs : list of dict
        Profile documents, each validated to hold what a comparison needs.
    labels : list of str
        A short, unique name of each run (``--profile`` name or model).
    """

    path: str
    kind: str
    runs: list
    labels: list


@dataclass(frozen=True)
class Difference:
    """One field that differs between a baseline and a new run."""

    field: str
    base: object
    new: object

    def describe(self) -> str:
        return f"{self.field}: {self.show(self.base)} (baseline) vs {self.show(self.new)} (new)"

    def show(self, value) -> str:
        """``value`` for people. A null environment field was not recorded ("unknown"); a null workload or
        settings field is a feature the run did not use ("none": ``workload.prefill`` null means no
        chunked-prefill requests)."""
        if value is None and not self.field.startswith("environment."):
            return NO_VALUE.get(self.field, "none")
        return _show(value)

    def as_dict(self) -> dict:
        return {"field": self.field, "base": self.base, "new": self.new}


def _show(value) -> str:
    return "unknown" if value is None else json.dumps(value) if not isinstance(value, str) else repr(value)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------- reading


def _check_run(run, where: str) -> dict:
    """Raise BaselineError unless ``run`` is a profile document with samples."""
    if not isinstance(run, dict) or run.get("kind") != PROFILE_KIND:
        raise BaselineError(f"{where} is not a kvaddr profile report (kind {PROFILE_KIND!r})")
    version = run.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BaselineError(
            f"{where} has profile schema_version {version!r}; this kvaddr reads version {SCHEMA_VERSION}"
        )
    for key, kind in (("environment", dict), ("workload", dict), ("settings", dict), ("shapes", list)):
        if not isinstance(run.get(key), kind):
            raise BaselineError(f"{where} has no {key!r} {kind.__name__}")
    for s in run["shapes"]:
        if not isinstance(s, dict) or not isinstance(s.get("batch"), int) or not isinstance(s.get("results"), list):
            raise BaselineError(f"{where} has a shape without 'batch' and 'results'")
        for r in s["results"]:
            samples = r.get("samples_us") if isinstance(r, dict) else None
            if (
                not isinstance(samples, list)
                or not samples
                or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in samples
                )
            ):
                raise BaselineError(
                    f"{where}, batch {s['batch']}: a result has no raw samples ('samples_us', finite numbers)",
                )
            for key in ("strategy", "mode", "clock"):
                if not isinstance(r.get(key), str):
                    raise BaselineError(f"{where}, batch {s['batch']}: a result has no {key!r}")
    return run


def from_document(doc, path: str) -> Baseline:
    """Validate a parsed document (a baseline or a profile report) as a :class:`Baseline`."""
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind == BASELINE_KIND:
        fmt = doc.get("baseline_format")
        if fmt != BASELINE_FORMAT:
            raise BaselineError(f"{path} has baseline_format {fmt!r}; this kvaddr reads format {BASELINE_FORMAT}")
        runs = doc.get("runs")
        if not isinstance(runs, list) or not runs:
            raise BaselineError(f"{path} holds no runs")
        runs = [_check_run(r, f"{path}, run {i + 1}") for i, r in enumerate(runs)]
    elif kind == PROFILE_KIND:
        runs = [_check_run(doc, path)]
    else:
        raise BaselineError(
            f"{path} is neither a kvaddr baseline nor a kvaddr profile report "
            f"(kind {kind!r}; expected {BASELINE_KIND!r} or {PROFILE_KIND!r})",
        )
    return Baseline(path, kind, runs, run_labels(runs))


def load(path: str) -> Baseline:
    """Read a baseline file, or a ``kvaddr profile --json`` report as a one-run baseline.

    Raises
    ------
    BaselineError
        Exit 2: the file is missing, not JSON, or not a kvaddr baseline/report.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        raise BaselineError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BaselineError(f"{path} is a folder, not a baseline file") from None
    except OSError as exc:
        raise BaselineError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BaselineError(f"{path} is not JSON ({exc})") from None
    return from_document(doc, path)


# ----------------------------------------------------------------------------- identity


def _get(doc: dict, dotted: str):
    value = doc
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def run_key(run: dict) -> str:
    """What makes two runs comparable: workload, batch sizes, modes and device kind."""
    workload = {k: v for k, v in run["workload"].items() if k not in WORKLOAD_IGNORED}
    settings = run["settings"]
    return json.dumps(
        {
            "workload": workload,
            "batches": settings.get("batches"),
            "modes": settings.get("modes"),
            "device": run["environment"].get("device"),
        },
        sort_keys=True,
    )


def _profile_name(path: str) -> str:
    """``profiles/deepseek-v3.2-mtp.toml`` -> ``deepseek-v3.2-mtp``."""
    base = os.path.basename(path)
    return base[:-5] if base.endswith(".toml") else base


def run_labels(runs: list) -> list:
    """A short unique name per run: its ``--profile`` name when it has one, else its model."""
    names = []
    for run in runs:
        profile = (run.get("options") or {}).get("workload_profile")  # kvaddr profile --profile: its path
        names.append(
            _profile_name(profile) if isinstance(profile, str) and profile else str(run["workload"].get("model", "run"))
        )
    out = []
    for i, name in enumerate(names):
        out.append(name if names.count(name) == 1 else f"{name} #{names[: i + 1].count(name)}")
    return out


def environment_differences(base_env: dict, new_env: dict, relative: bool = False) -> tuple:
    """Compare two ``environment`` objects.

    Parameters
    ----------
    relative : bool
        Machine-independent comparison: only the device kind must match; the
        GPU and driver become notes.

    Returns
    -------
    (list of Difference, list of Difference)
        Mismatches (the device kind, and unless ``relative`` the GPU model,
        compute capability, SM count, NVIDIA driver and CUDA driver API
        version, or the CPU on the CPU path), and notes (other versions that
        differ, and fields unknown on one side).
    """
    mismatches, notes = [], []
    base_dev, new_dev = base_env.get("device"), new_env.get("device")
    if base_dev != new_dev:
        mismatches.append(Difference("device", base_dev, new_dev))
    machine = MACHINE_FIELDS.get(base_dev, ())
    for f in machine + NOTE_FIELDS:
        b, n = _get(base_env, f), _get(new_env, f)
        if b == n:
            continue
        gated = f in machine and not relative and b is not None and n is not None
        (mismatches if gated else notes).append(Difference(f"environment.{f}", b, n))
    return mismatches, notes


def workload_differences(base_run: dict, new_run: dict) -> list:
    """Fields of the workload, batch sizes and modes that differ (always a mismatch)."""
    out = []
    bw, nw = base_run["workload"], new_run["workload"]
    for k in dict.fromkeys(list(bw) + list(nw)):
        if k not in WORKLOAD_IGNORED and bw.get(k) != nw.get(k):
            out.append(Difference(f"workload.{k}", bw.get(k), nw.get(k)))
    for k in ("batches", "modes"):
        b, n = base_run["settings"].get(k), new_run["settings"].get(k)
        if b != n:
            out.append(Difference(f"settings.{k}", b, n))
    return out


def machine_summary(env: dict) -> str:
    """``NVIDIA H200 (driver 580.159.04, CUDA 13.0)`` or ``CPU x86_64``."""
    if env.get("device") == "cuda":
        gpu = env.get("gpu") or {}
        return (
            f"{gpu.get('name', 'unknown GPU')} (driver {env.get('driver_version') or 'unknown'}, CUDA driver API "
            f"{env.get('cuda_driver') or 'unknown'})"
        )
    return f"CPU {env.get('cpu') or 'unknown'}"


# ----------------------------------------------------------------------------- writing


def check_writable(path: str) -> str | None:
    """Why ``path`` cannot be written (its folder is missing or read-only, or it is a folder), else None."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path!r} is a folder"
    if not os.path.isdir(parent):
        return f"the folder {parent!r} does not exist"
    if not os.access(parent, os.W_OK):
        return f"the folder {parent!r} is not writable"
    return None


def save_target_problem(path: str) -> str | None:
    """Why ``--save path`` cannot work (checked before profiling), else None."""
    why = check_writable(path)
    if why is None and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                old = json.load(fh)
            kind = old.get("kind") if isinstance(old, dict) else None
        except (OSError, ValueError, UnicodeDecodeError):
            kind = None
        if kind != BASELINE_KIND:
            why = f"{path!r} exists and is not a kvaddr baseline; it is left as it is: remove it or choose another file"
    return why


_NUMBER_ARRAY = re.compile(r"\[\n\s+(-?[0-9][0-9.eE+-]*(?:,\n\s+-?[0-9][0-9.eE+-]*)*)\n\s*\]")


def dumps(doc: dict) -> str:
    """JSON with two-space indents, arrays of numbers on one line (samples stay compact)."""
    text = json.dumps(doc, indent=2)
    return _NUMBER_ARRAY.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def save_runs(path: str, runs: list) -> list:
    """Write ``runs`` (profile documents) as a baseline at ``path``.

    A new file holds just these runs. When ``path`` already holds a baseline,
    each run replaces the run with the same :func:`run_key`, or is added;
    every run must come from the same machine as the file's first run.

    Returns
    -------
    list of str
        What happened to each run, e.g. ``"added run 2 (glm-5)"``.

    Raises
    ------
    BaselineError
        When ``path`` exists but is not a kvaddr baseline (it is never
        overwritten).
    BaselineMismatch
        When the runs come from another machine than the file's.
    BaselineWriteError
        When the file cannot be written.
    """
    existing: list = []
    created = _now()
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                old = json.load(fh)
            if not isinstance(old, dict) or old.get("kind") != BASELINE_KIND:
                raise BaselineError("not a kvaddr baseline")
            existing = list(from_document(old, path).runs)
            created = old.get("created_utc") or created
        except (BaselineError, OSError, ValueError, UnicodeDecodeError) as exc:
            raise BaselineError(
                f"{path} exists and is not a kvaddr baseline ({exc}); it is left "
                f"as it is: remove it or choose another file",
            ) from None
    actions = []
    for run in runs:
        if existing:
            mismatches, _ = environment_differences(existing[0]["environment"], run["environment"])
            if mismatches:
                raise BaselineMismatch(
                    f"{path} holds runs measured on "
                    f"{machine_summary(existing[0]['environment'])}; this run ran on "
                    f"{machine_summary(run['environment'])} "
                    f"({'; '.join(d.describe() for d in mismatches)}): save it to "
                    f"another file",
                )
        key = run_key(run)
        keys = [run_key(r) for r in existing]
        if key in keys:
            i = keys.index(key)
            existing[i] = run
            actions.append(f"replaced run {i + 1} ({run_labels(existing)[i]})")
        else:
            existing.append(run)
            actions.append(f"added run {len(existing)} ({run_labels(existing)[-1]})")
    doc = {
        "kind": BASELINE_KIND,
        "baseline_format": BASELINE_FORMAT,
        "created_utc": created,
        "updated_utc": _now(),
        "runs": existing,
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(dumps(doc))
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise BaselineWriteError(f"cannot write {path}: {exc.strerror or exc}") from None
    return actions
