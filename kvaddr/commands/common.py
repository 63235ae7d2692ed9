"""What every ``kvaddr`` command shares: consoles, exit codes and the guard that maps
exceptions to them, option types and shared options, ``--profile``, mode and block-size
resolution, output-path checks and the progress display.

Conventions of every command: data (tables, JSON) on stdout, status and errors on
stderr, a progress bar only on a terminal, no Python traceback for a user's mistake
(``KVADDR_DEBUG=1`` shows one for internal errors). Exit status (:data:`EXIT_CODES_HELP`):
0 ok, 1 a check failed (or an internal error), 2 usage, 3 environment, 141 a closed stdout.
Every command's help ends with examples (:func:`examples`) and names option values by
kind (:data:`METAVARS`); output paths are checked before the work (:func:`check_output_path`).

The library and the measurement, traces and gate layers raise typed exceptions
(:mod:`kvaddr.errors`); only :func:`guarded` turns them into exit codes.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import stat
import sys

import click

from kvaddr.constants import MAX_CACHES, MAX_CONTEXT, MAX_TOKENS_PER_STEP, MODES
from kvaddr.errors import (
    BaselineError,
    BaselineMismatch,
    BaselineWriteError,
    CheckFailed,
    EnvironmentProblem,
    KernelCompileError,
    KvaddrError,
    ProfileConfigError,
    ProfileError,
    RevisionError,
    TraceError,
)

EXIT_OK, EXIT_CHECK, EXIT_USAGE, EXIT_ENV = 0, 1, 2, 3
#: A closed stdout (``kvaddr profile | head -1``): 128 + SIGPIPE, what a shell reports for a process the
#: signal ended; kvaddr stops quietly, printing nothing on stderr.
EXIT_PIPE = 141

#: The closed-pipe line every command's exit-status text ends with.
EXIT_PIPE_HELP = "  141  stdout was closed early (| head): kvaddr stops quietly"

EXIT_CODES_HELP = f"""\b
Exit status:
    0  ok
    1  a check failed: a strategy's output differs from the reference
       (or kvaddr hit an internal error)
    2  usage error: a bad option value, or an output PATH (--json,
       --save, --plot) that cannot be written, found before any work
    3  environment problem: --device cuda without a CUDA device, CuPy
       missing, kernels.cu does not compile for this GPU, or an output
       file whose write fails at the end (a full disk)
{EXIT_PIPE_HELP}
"""

# ----------------------------------------------------------------------------- help conventions

#: Metavars of option values, by kind (tests/unit/test_help.py holds every command to them): an integer
#: ``N``; a list of integers ``N[,N...]``; a range ``N|LO:HI``; a number with a unit its unit (``SECONDS``,
#: ``MS``), any other number ``X``; a file ``PATH``; a choice click's ``[a|b]``.
METAVARS = {
    "int": "N",
    "int_list": "N[,N...]",
    "range": "N|LO:HI",
    "float": ("X", "SECONDS", "MS"),
    "path": "PATH",
}


def examples(*lines: str) -> str:
    """A command's epilog: ``Examples:`` and 2-3 command lines, kept from rewrapping (``\\b``)."""
    if not 2 <= len(lines) <= 3:
        raise ValueError("a command's help ends with two or three examples")
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


class IntBounds(click.IntRange):
    """``click.IntRange`` with metavar ``N``, whose help shows ``x>=LO`` instead of an upper bound that is
    only a machine limit (``0<=x<=9223372036854775807``)."""

    #: Upper bounds at or above this are not shown.
    SHOWN_BELOW = 1 << 31

    def _describe_range(self) -> str:
        if self.max is not None and self.max >= self.SHOWN_BELOW:
            return f"x>={self.min}" if self.min is not None else ""
        return super()._describe_range()

    def get_metavar(self, param, ctx=None):
        return METAVARS["int"]


class FloatBounds(click.FloatRange):
    """``click.FloatRange`` with metavar ``X`` (an option with a unit names it instead: ``SECONDS``)."""

    def get_metavar(self, param, ctx=None):
        return METAVARS["float"][0]


#: Exception types and the exit status each means (the first match wins; CheckFailed is handled apart).
EXIT_FOR = (
    (BaselineMismatch, EXIT_ENV),
    (BaselineWriteError, EXIT_ENV),
    (BaselineError, EXIT_USAGE),
    (EnvironmentProblem, EXIT_ENV),
    (KernelCompileError, EXIT_ENV),
    (ProfileConfigError, EXIT_USAGE),
    (ProfileError, EXIT_USAGE),
    (TraceError, EXIT_USAGE),
    (RevisionError, EXIT_USAGE),
)

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}


# ----------------------------------------------------------------------------- consoles


def err_console():
    """A rich console on stderr (no markup, no highlighting)."""
    from rich.console import Console

    return Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


def out_console():
    """A rich console on stdout, 240 columns wide when stdout is not a terminal; a closed stdout
    (``| head``) ends the command quietly with :data:`EXIT_PIPE` (rich's own handler exits 1)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            exit_quietly_on_closed_pipe()

    wide = None if sys.stdout.isatty() else 240
    return _Console(markup=False, highlight=False, width=wide)


# ----------------------------------------------------------------------------- exits


class Abort(KvaddrError):
    """Stop a command with exit status ``code`` after printing the message on stderr."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def exit_code_for(exc: BaseException) -> int | None:
    """The exit status a kvaddr exception means (None: not one :data:`EXIT_FOR` knows)."""
    for kind, code in EXIT_FOR:
        if isinstance(exc, kind):
            return code
    return None


def guarded(command_name: str):
    """Map every failure of a command to a message on stderr and an exit status."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            err = err_console()
            try:
                return fn(*args, **kwargs)
            except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
                raise
            except Abort as exc:
                err.print(f"kvaddr {command_name}: {exc}")
                code = exc.code
            except CheckFailed as exc:
                err.print(f"kvaddr {command_name}: check failed: {exc}")
                err.print("no timing is reported until every strategy matches the reference")
                code = EXIT_CHECK
            except KeyboardInterrupt:
                err.print(f"kvaddr {command_name}: interrupted")
                code = 130
            except Exception as exc:
                if is_broken_pipe(exc):
                    exit_quietly_on_closed_pipe()
                code = exit_code_for(exc)
                if code is not None:
                    err.print(f"kvaddr {command_name}: {exc}")
                else:
                    if os.environ.get("KVADDR_DEBUG"):
                        raise
                    err.print(
                        f"kvaddr {command_name}: internal error: {type(exc).__name__}: {exc} "
                        f"(set KVADDR_DEBUG=1 for a traceback)"
                    )
                    code = EXIT_CHECK
            raise SystemExit(code)

        return run

    return wrap


def trace_instead(path: str) -> str | None:
    """Why ``path`` is no report or baseline, when it is a kvaddr trace (JSON Lines, gzip or not); else None."""
    from kvaddr.traces.format import TraceReader

    try:
        with TraceReader(path):
            pass
    except (TraceError, OSError, ValueError):
        return None
    return (
        f"{path} is a kvaddr trace (JSON Lines, one serving step per line), not a profile report or baseline: "
        f"`kvaddr replay {path}` times it; `kvaddr compare`, `check` and `sweep --from` read a `kvaddr profile "
        f"--save` baseline or a `kvaddr profile --json` report"
    )


def load_report(path: str):
    """A baseline file or profile report (:func:`kvaddr.gate.baseline_file.load`); a trace given instead is
    named as one (:func:`trace_instead`) rather than reported as a file that is not JSON.

    Raises
    ------
    BaselineError
        Exit 2: missing, not JSON, a trace, or not a kvaddr baseline or report.
    """
    from kvaddr.gate.baseline_file import load

    try:
        return load(path)
    except BaselineError as exc:
        why = trace_instead(path) if os.path.isfile(path) else None
        if why is None:
            raise
        raise BaselineError(why) from exc


def write_json(doc: dict, json_path: str, command: str) -> None:
    """Write a command's JSON document to ``json_path`` (``-``, stdout, is the caller's)."""
    try:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    except OSError as exc:
        raise Abort(EXIT_ENV, f"cannot write --json {json_path!r}: {exc.strerror or exc}") from None
    err_console().print(f"kvaddr {command}: JSON report written to {json_path}")


#: Formats ``sweep --plot`` draws, by file extension (matplotlib's own writers, no extra package needed).
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff")


def output_path_problem(path: str, *, regular: bool = False) -> str | None:
    """Why ``path`` cannot be written, found without changing it; None when it can.

    * a new file: its folder must exist and be writable;
    * an existing regular file: it is opened for appending and closed at once
      (no byte written, not truncated: a run that fails later leaves it as it was);
    * an existing character device (``/dev/null``, ``/dev/full``, a terminal): one
      write of zero bytes, which the device answers as it would a real write
      (``/dev/full``: "No space left on device");
    * a FIFO (``/dev/stdout`` on a pipe): writable by permission; not opened, as
      opening a FIFO waits for its reader.

    ``regular``: only a regular file (new or existing) will do (``--save``, which reads it back).
    """
    if os.path.isdir(path):
        return f"{path!r} is a folder"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        return f"cannot write {path!r}: {exc.strerror or exc}"
    if st is None:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return f"the folder {parent!r} does not exist"
        if not os.access(parent, os.W_OK):
            return f"the folder {parent!r} is not writable"
        return None
    try:
        if stat.S_ISREG(st.st_mode):
            with open(path, "ab"):
                pass
        elif regular:
            return f"{path!r} is not a regular file"
        elif stat.S_ISCHR(st.st_mode):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"")
            finally:
                os.close(fd)
        elif not os.access(path, os.W_OK):
            return f"cannot write {path!r}: permission denied"
    except OSError as exc:
        return f"cannot write {path!r}: {exc.strerror or exc}"
    return None


def check_output_path(path: str | None, option: str, *, extensions: tuple | None = None, regular: bool = False) -> None:
    """Usage error (exit 2) naming ``option`` unless ``path`` can be written (:func:`output_path_problem`);
    ``'-'`` and None pass. Called before any work, so a bad path costs nothing.

    ``extensions``: the file name must end in one of them (``--plot``: :data:`PLOT_FORMATS`).
    """
    if path in (None, "-"):
        return
    hint = " / ".join(f"'{o}'" for o in option.split(" / "))
    if extensions is not None:
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        if ext not in extensions:
            raise click.BadParameter(
                f"{path!r}: the file name must end in one of {', '.join('.' + e for e in extensions)}"
                + (f" (not .{ext})" if ext else ""),
                param_hint=hint,
            )
    why = output_path_problem(path, regular=regular)
    if why:
        raise click.BadParameter(why, param_hint=hint)


# ----------------------------------------------------------------------------- a closed stdout


def is_broken_pipe(exc: BaseException) -> bool:
    """``exc`` is a write to a pipe whose reader went away (EPIPE)."""
    return isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE)


def exit_quietly_on_closed_pipe() -> None:
    """The reader of stdout went away (``| head``): stop now, quietly, with :data:`EXIT_PIPE`.

    stdout is pointed at /dev/null first, so that Python's final flush of what is
    still buffered neither fails nor prints "Exception ignored ... BrokenPipeError"
    (the recipe of Python's docs, "Note on SIGPIPE").
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    raise SystemExit(EXIT_PIPE)


# ----------------------------------------------------------------------------- device, modes, block sizes


def use_cuda_for(device: str, command: str, verb: str) -> bool:
    """Resolve ``--device auto|cuda|cpu``: True for the GPU. ``--device cuda`` without a
    usable GPU exits 3; ``auto`` without one says so on stderr (``<verb> the NumPy
    strategies on the CPU``)."""
    from kvaddr.measure.environment import use_gpu

    use_cuda, reason = use_gpu(device)
    if reason is not None:
        err_console().print(f"kvaddr {command}: no CUDA device found: {reason}; {verb} the NumPy strategies on the CPU")
    return use_cuda


def resolve_modes(mode: str | None, use_cuda: bool, command: str) -> tuple:
    """``--mode`` as the modes to run: the GPU runs the one asked (both by default), the CPU eager only
    (``--mode graph`` exits 3 there; ``both`` says on stderr that only eager mode runs)."""
    if use_cuda:
        return {"eager": ("eager",), "graph": ("graph",)}.get(mode, MODES)
    if mode == "graph":
        raise Abort(
            EXIT_ENV,
            f"--mode graph: CUDA graphs need a GPU; kvaddr {command} runs the NumPy strategies on the CPU "
            "here, eager only: leave out --mode or give --mode eager",
        )
    if mode == "both":
        err_console().print(f"kvaddr {command}: graph mode needs a CUDA device; the CPU path measures eager mode only")
    return ("eager",)


def resolve_block_sizes(sizes, num_caches: int, option_hint: str = "'--block-size'") -> tuple:
    """One B per cache: one size for all, or exactly one per cache."""
    if len(sizes) == 1:
        return tuple(sizes) * num_caches
    if len(sizes) != num_caches:
        raise click.BadParameter(
            f"got {len(sizes)} block sizes for {num_caches} caches (give one size, or one per cache)",
            param_hint=option_hint,
        )
    return tuple(sizes)


# ----------------------------------------------------------------------------- option types


def parse_int(text: str, what: str, lo: int, hi: int) -> int:
    """``text`` as an integer in ``[lo, hi]``; ValueError naming ``what`` otherwise."""
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text.strip()!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be in [{lo}, {hi}], got {value}")
    return value


class IntList(click.ParamType):
    """One integer or a comma-separated list of them."""

    name = "N[,N...]"

    def __init__(self, lo: int, hi: int, what: str):
        self.lo, self.hi, self.what = lo, hi, what

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = str(value).split(",")
        try:
            out = tuple(parse_int(p, self.what, self.lo, self.hi) for p in parts)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return out


class IntRangeSpec(click.ParamType):
    """``N`` or ``LO:HI`` (inclusive)."""

    name = "N|LO:HI"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value)
        try:
            if ":" in text:
                lo_text, hi_text = text.split(":", 1)
                lo = parse_int(lo_text, "LO", 0, MAX_CONTEXT)
                hi = parse_int(hi_text, "HI", 0, MAX_CONTEXT)
            else:
                lo = hi = parse_int(text, "N", 0, MAX_CONTEXT)
        except ValueError as exc:
            self.fail(f"{exc} (expected N or LO:HI context tokens)", param, ctx)
        if lo > hi:
            self.fail(f"LO must be <= HI, got {lo}:{hi}", param, ctx)
        return lo, hi


class PrefillSpec(click.ParamType):
    """``N:LEN``: N chunked-prefill requests of LEN tokens."""

    name = "N:LEN"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value)
        if ":" not in text:
            self.fail(f"expected N:LEN (requests:tokens), got {text!r}", param, ctx)
        n_text, len_text = text.split(":", 1)
        try:
            n = parse_int(n_text, "N", 0, 1 << 20)
            length = parse_int(len_text, "LEN", 1, MAX_TOKENS_PER_STEP)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return n, length


def finite(ctx, param, value):
    """Option callback: reject nan and inf, which click's FloatRange lets through."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}", ctx=ctx, param=param)
    return value


# ----------------------------------------------------------------------------- shared options


def apply(*decorators):
    """One decorator applying ``decorators`` in order (the first is the outermost)."""

    def wrap(fn):
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return wrap


def device_option():
    return click.option(
        "--device",
        type=click.Choice(["auto", "cuda", "cpu"]),
        default="auto",
        show_default=True,
        help="Where to run the strategies: auto = the GPU if CuPy finds one, else the CPU.",
    )


def mode_option():
    return click.option(
        "--mode",
        type=click.Choice(["eager", "graph", "both"]),
        default=None,
        help="GPU launch mode. [default: both on a GPU; the CPU path has eager only]",
    )


def layers_option():
    return click.option(
        "--layers", type=IntBounds(1, 4096), default=None, help="Transformer layers. [default: the model's]"
    )


def caches_option(help_text: str = "Paged caches per layer. [default: the model's, 2]"):
    return click.option("--caches", type=IntBounds(1, MAX_CACHES), default=None, help=help_text)


def block_size_option(
    help_text: str = "Tokens per block: one for every cache, or one per cache. [default: the model's, 64]",
):
    return click.option(
        "--block-size", "block_sizes", type=IntList(1, 1 << 20, "block size"), default=None, help=help_text
    )


def json_option(help_text: str = "Write the JSON report to PATH ('-': stdout, and nothing else there)."):
    return click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False, allow_dash=True),
        default=None,
        metavar="PATH",
        help=help_text,
    )


# ----------------------------------------------------------------------------- --profile (workload profiles)


def _param_for(command, key: str):
    flag = "--" + key.replace("_", "-")
    for p in command.params:
        if flag in getattr(p, "opts", ()):
            return p
    return None


def command_defaults(profile, section: str, ctx) -> dict:
    """The profile's ``[section]`` values for ``ctx.command``, checked by each option.

    Keys of the section that the command has no option for are left out (a
    ``[profile]`` table serves ``profile``, ``sweep`` and ``replay``, which
    take different subsets of it).

    Returns
    -------
    dict
        ``{param.name: converted value}``, ready for ``ctx.default_map``.

    Raises
    ------
    ProfileError
        A value the option rejects, naming the file, the line and the key.
    """
    from kvaddr.measure.profiles import option_text

    out = {}
    for key, value in profile.tables.get(section, {}).items():
        param = _param_for(ctx.command, key)
        if param is None:
            continue
        where = dict(path=profile.path, line=profile.line_of(section, key), key=f"{section}.{key}")
        try:
            text = option_text(key, value)
            converted = param.type_cast_value(ctx, text)
            if param.callback is not None:
                converted = param.callback(ctx, param, converted)
        except ValueError as exc:  # option_text
            raise ProfileError(f"[{section}] {key}: {exc}", **where) from None
        except click.BadParameter as exc:
            raise ProfileError(f"[{section}] {key} = {value!r}: {exc.message}", **where) from None
        out[param.name] = text  # click converts it (and runs the callback) as for the command line
    return out


def profile_option(section: str):
    """A ``--profile NAME|PATH`` click option that fills the command's other options.

    The option is eager: it loads the profile before the other options are
    processed and puts its ``[section]`` values into ``ctx.default_map``, so
    an option given on the command line still wins. Its value (exposed as
    ``workload_profile``) is the profile's path.
    """

    def callback(ctx, param, value):
        from kvaddr.measure.profiles import load_profile

        if value is None or ctx.resilient_parsing:
            return value
        try:
            prof = load_profile(value)
            defaults = command_defaults(prof, section, ctx)
        except ProfileError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
        return prof.path

    return click.option(
        "--profile",
        "workload_profile",
        metavar="NAME|PATH",
        default=None,
        is_eager=True,
        callback=callback,
        help=f"Take the options this command has from a workload profile's [{section}] table (a name from "
        f"`kvaddr profiles`, or a .toml file); options given on the command line win.",
    )


# ----------------------------------------------------------------------------- progress


def bar_progress(err, total):
    """A rich progress bar on stderr (transient), or None when stderr is not a terminal."""
    if not err.is_terminal:
        return None
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    cols = [TextColumn("{task.description}"), BarColumn()]
    if total:
        cols.append(TaskProgressColumn())
    cols.append(TimeElapsedColumn())
    return Progress(*cols, console=err, transient=True)
