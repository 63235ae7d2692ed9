"""The ``kvaddr`` command: the click group and its commands (``kvaddr = kvaddr.cli:main``).

The commands live in :mod:`kvaddr.commands` (one module each, sharing
:mod:`kvaddr.commands.common`); this module only builds the group and adds them.
Data (tables, JSON) goes to stdout, status and errors to stderr. Exit status:
0 ok, 1 a check failed (or kvaddr hit an internal error), 2 usage error (an
output path that cannot be written included, found before any work),
3 environment problem (no GPU for ``--device cuda``, no CuPy, kernels.cu does
not compile, an output write that fails at the end), 141 stdout closed early
(``| head``; quiet). User errors never print a Python traceback; set
``KVADDR_DEBUG=1`` to get one for internal errors.
"""

from __future__ import annotations

import click

from kvaddr.commands import gate, profile, traces
from kvaddr.commands.common import (
    CONTEXT_SETTINGS,
    EXIT_CODES_HELP,
    examples,
    exit_quietly_on_closed_pipe,
    is_broken_pipe,
)

# ----------------------------------------------------------------------------- the group


def _print_version(ctx, _param, value):
    if not value or ctx.resilient_parsing:
        return
    from kvaddr.measure.environment import kvaddr_version

    click.echo(f"kvaddr {kvaddr_version()}")
    ctx.exit(0)


@click.group(
    name="kvaddr",
    context_settings=CONTEXT_SETTINGS,
    epilog=EXIT_CODES_HELP
    + "\n"
    + examples(
        "kvaddr profile --batch 64",
        "kvaddr info",
        "kvaddr sweep --batch 1,16,256,1024 --plot sweep.png",
    ),
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def cli():
    """kvaddr: KV-cache step addressing for LLM serving, in one kernel launch per step.

    `kvaddr profile` measures what per-layer slot mapping costs a decode step
    and what hoisting it, or fusing the whole step's addressing into one
    launch, saves; `kvaddr info` reports the GPU, CUDA and kernel-compile
    status.
    """


# ----------------------------------------------------------------------------- the commands

cli.add_command(profile.profile)
cli.add_command(profile.info)
# the regression gate on saved baselines
cli.add_command(gate.compare)
cli.add_command(gate.check)
# traces, sweeps and workload profiles
cli.add_command(traces.trace_group)
cli.add_command(traces.replay)
cli.add_command(traces.sweep)
cli.add_command(traces.profiles)

#: The group under the name the issue gives it.
kvaddr = cli


def main(args=None) -> None:
    """Console entry point (``kvaddr = kvaddr.cli:main``).

    Runs the group as click's standalone mode does (usage errors shown, exit 2;
    Ctrl-C "Aborted!", exit 1), except for a closed stdout (``kvaddr profile |
    head -1``): click exits 1 there, which means "a check failed"; kvaddr stops
    quietly with 141 (128 + SIGPIPE, what a shell reports for ``yes | head``),
    nothing on stderr (:func:`kvaddr.commands.common.exit_quietly_on_closed_pipe`).
    """
    import sys

    try:
        rv = cli.main(args=args, prog_name="kvaddr", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except OSError as exc:
        if not is_broken_pipe(exc):
            raise
        exit_quietly_on_closed_pipe()
    # Without standalone mode click returns an Exit's code (``ctx.exit(n)``, --help, --version) as rv.
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
