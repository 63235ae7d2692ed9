"""Workload profiles: TOML files that fill in the options of kvaddr's commands.

A profile names a workload once, with where its numbers come from, so that
``kvaddr profile --profile deepseek-v3.2-mtp`` (or ``sweep``, ``replay`` and
``trace generate``) runs it without a long command line. The format
(docs/profiles.md)::

    description = "DeepSeek-V3.2 decode with MTP (1 speculative token)"
    source = "docs/spec.md (61 layers, 2 caches, B = 64); DeepSeek-V3 report ..."

    [profile]            # options of `kvaddr profile` (`sweep` and `replay` use the ones they have)
    model = "deepseek-v3.2"
    batch = [1, 8, 64, 256]
    spec_tokens = 1

    [trace]              # options of `kvaddr trace generate`
    spec_tokens = 1
    acceptance = 0.85

Every key of a table is the long name of one of the command's options with
``_`` for ``-`` (``spec_tokens`` is ``--spec-tokens``); a value is what the
option takes, as a TOML string, number or list (``batch = [1, 8]`` is
``--batch 1,8``, ``context = [1024, 32768]`` is ``--context 1024:32768``).
Options given on the command line win over the profile's values; the
profile's values win over the options' defaults.

Where profiles are found: a reference that ends in ``.toml`` or holds a path
separator is a file; any other reference is a name looked up as
``NAME.toml`` in each folder of ``$KVADDR_PROFILE_PATH`` (``os.pathsep``
separated), then in the profiles kvaddr ships (:func:`bundled_dirs`).

A malformed file, an unknown table or key, or a value the option rejects
raises :class:`ProfileError` naming the file, the line and the key. The
``--profile`` click option that applies a profile to a command is
:func:`kvaddr.commands.common.profile_option`.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvaddr.errors import ProfileError

#: The tables a profile may hold, and the keys each may hold.
PROFILE_KEYS = (
    "model",
    "batch",
    "context",
    "spec_tokens",
    "prefill",
    "block_size",
    "layers",
    "caches",
    "mode",
    "step_ms",
    "seed",
    "budget",
    "input_sets",
    "engine",
    "attention",
    "kv_indices_capacity",
)
TRACE_KEYS = (
    "model",
    "steps",
    "warmup_steps",
    "arrival_rate",
    "prompt_len",
    "output_len",
    "max_running",
    "max_batched_tokens",
    "spec_tokens",
    "acceptance",
    "block_size",
    "caches",
    "kv_tokens",
    "max_waiting",
    "seed",
)
SECTIONS = {"profile": PROFILE_KEYS, "trace": TRACE_KEYS}
#: Top-level keys (strings).
TOP_KEYS = ("description", "source")
#: Keys whose TOML list is joined into the option's text form with this separator.
LIST_JOIN = {"batch": ",", "block_size": ",", "attention": ",", "context": ":", "prefill": ":"}
#: Environment variable with extra folders of profiles.
PATH_ENV = "KVADDR_PROFILE_PATH"


@dataclass
class Profile:
    """One loaded profile.

    Attributes
    ----------
    name : str
        The file's stem.
    path : str
    description, source : str
        Empty when the file does not say.
    tables : dict
        ``{"profile": {key: value}, "trace": {key: value}}`` as TOML gave
        them (absent tables are empty).
    lines : dict
        ``{"table.key": line}`` of every key found in the text.
    """

    name: str
    path: str
    description: str = ""
    source: str = ""
    tables: dict = field(default_factory=dict)
    lines: dict = field(default_factory=dict)

    def line_of(self, section: str, key: str) -> int | None:
        return self.lines.get(f"{section}.{key}")

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "description": self.description,
            "source": self.source,
            **{s: dict(self.tables.get(s, {})) for s in SECTIONS},
        }


# ----------------------------------------------------------------------------- finding profiles


def bundled_dirs() -> list:
    """Folders of the profiles kvaddr ships, in search order.

    ``profiles/`` next to the package in a source checkout; ``kvaddr/profiles/``
    inside the package (package data); ``share/kvaddr/profiles`` under the
    installation prefixes (a wheel's ``data_files``). Only existing folders
    are returned.
    """
    here = Path(__file__).resolve().parents[1]  # the kvaddr package
    candidates = []
    root = here.parent
    if (root / "setup.cfg").is_file() and (root / "kvaddr").is_dir():
        candidates.append(root / "profiles")
    candidates.append(here / "profiles")
    prefixes = [sys.prefix, getattr(sys, "base_prefix", sys.prefix)]
    try:
        import site

        prefixes.append(site.getuserbase())
    except Exception:  # pragma: no cover - site is always there on CPython
        pass
    candidates.extend(Path(p) / "share" / "kvaddr" / "profiles" for p in prefixes)
    out, seen = [], set()
    for c in candidates:
        key = str(c)
        if key not in seen and c.is_dir():
            seen.add(key)
            out.append(c)
    return out


def search_dirs() -> list:
    """``$KVADDR_PROFILE_PATH`` folders, then :func:`bundled_dirs`."""
    extra = [Path(p) for p in os.environ.get(PATH_ENV, "").split(os.pathsep) if p]
    return [d for d in extra if d.is_dir()] + bundled_dirs()


def _is_path(ref: str) -> bool:
    return ref.endswith(".toml") or "/" in ref or os.sep in ref


def available() -> dict:
    """``{name: path}`` of every profile on the search path (the first of a name wins)."""
    out: dict = {}
    for d in search_dirs():
        for p in sorted(d.glob("*.toml")):
            out.setdefault(p.stem, str(p))
    return out


def resolve(ref: str) -> str:
    """The file a profile reference names; raise :class:`ProfileError` if there is none."""
    ref = str(ref).strip()
    if not ref:
        raise ProfileError("the profile reference is empty (give a name, see `kvaddr profiles`, or a .toml path)")
    if _is_path(ref):
        if not os.path.isfile(ref):
            raise ProfileError(f"no such profile file: {ref}")
        return ref
    known = available()
    if ref in known:
        return known[ref]
    names = ", ".join(sorted(known)) or "none found"
    raise ProfileError(f"no profile named {ref!r} (known: {names}; or give a path to a .toml file)")


# ----------------------------------------------------------------------------- parsing


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ProfileError(
            "reading TOML profiles on Python < 3.11 needs the tomli package (pip install tomli)"
        ) from exc
    return tomli


_HEADER = re.compile(r"^\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_BARE = r"[A-Za-z0-9_\-]+"
_KEY = re.compile(rf"""^((?:{_BARE}|"[^"]*"|'[^']*')(?:\s*\.\s*(?:{_BARE}|"[^"]*"|'[^']*'))*)\s*=""")


def _unquote_dotted(text: str) -> list:
    parts = re.findall(rf"""{_BARE}|"[^"]*"|'[^']*'""", text)
    return [p[1:-1] if p[:1] in "\"'" else p for p in parts]


def key_lines(text: str) -> dict:
    """``{"table.key": line}`` (and ``{"key": line}`` at the top level) of a TOML text.

    A light scan, not a parser: it follows ``[table]`` headers, dotted keys
    and skips the inside of multi-line strings; the first occurrence of a key
    wins. Used to name the line of a key that TOML parsed but kvaddr rejects.
    """
    lines: dict = {}
    table: list = []
    in_multiline = None
    for no, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if in_multiline is not None:
            if s.count(in_multiline) % 2 == 1:
                in_multiline = None
            continue
        if not s or s.startswith("#"):
            continue
        if s.startswith("[") and not s.startswith("[["):
            m = _HEADER.match(s)
            if m:
                table = _unquote_dotted(m.group(1))
                lines.setdefault(".".join(table), no)
            continue
        m = _KEY.match(s)
        if not m:
            continue
        full = ".".join(table + _unquote_dotted(m.group(1)))
        lines.setdefault(full, no)
        rest = s[m.end() :]
        for quote in ('"""', "'''"):
            if rest.count(quote) % 2 == 1:
                in_multiline = quote
                break
    return lines


def parse_profile(text: str, path: str, name: str | None = None) -> Profile:
    """Parse and check a profile's text (see the module docstring).

    Raises
    ------
    ProfileError
        Not TOML (the message carries TOML's line and column), an unknown
        table or key, or a value of the wrong type.
    """
    toml = _toml()
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise ProfileError(f"not valid TOML: {exc}", path) from None
    lines = key_lines(text)
    prof = Profile(name=name or Path(path).stem, path=str(path), lines=lines)
    for key, value in data.items():
        line = lines.get(key)
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ProfileError(f"{key!r} must be a table ([{key}]), got {_type_name(value)}", path, line, key)
            known = SECTIONS[key]
            for sub, v in value.items():
                if sub not in known:
                    raise ProfileError(
                        f"unknown key {sub!r} in [{key}] (known: {', '.join(known)})",
                        path,
                        lines.get(f"{key}.{sub}"),
                        f"{key}.{sub}",
                    )
                if isinstance(v, dict):
                    raise ProfileError(
                        f"[{key}] {sub} must be a value, not a table", path, lines.get(f"{key}.{sub}"), f"{key}.{sub}"
                    )
            prof.tables[key] = dict(value)
        elif key in TOP_KEYS:
            if not isinstance(value, str):
                raise ProfileError(f"{key!r} must be a string, got {_type_name(value)}", path, line, key)
            setattr(prof, key, " ".join(value.split()))
        else:
            known = ", ".join(TOP_KEYS + tuple(f"[{s}]" for s in SECTIONS))
            raise ProfileError(f"unknown key {key!r} (known: {known})", path, line, key)
    return prof


def load_profile(ref: str) -> Profile:
    """Find (:func:`resolve`), read and parse a profile."""
    path = resolve(ref)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ProfileError(f"cannot read the profile: {exc.strerror or exc}", path) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"not valid TOML: not UTF-8 text (byte {exc.start})", path) from None
    return parse_profile(text, path)


def _type_name(value) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a table",
    }.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- applying to a command


def option_text(key: str, value) -> str:
    """A profile value as the text its command-line option takes.

    Raises
    ------
    ValueError
        A boolean, a table, or a list where the option takes one value.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a number or a string, got {str(value).lower()}")
    if isinstance(value, list):
        sep = LIST_JOIN.get(key)
        if sep is None:
            raise ValueError(f"takes one value, got a list {value!r}")
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise ValueError(f"expected a list of integers, got {value!r}")
        return sep.join(str(v) for v in value)
    if isinstance(value, dict):
        raise ValueError("takes a value, not a table")
    return str(value)
