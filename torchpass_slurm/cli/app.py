"""The application object shared by every command, and the error boundary.

Every command receives an :class:`App` through the click context
(``@pass_app``). :func:`run_cli` is the only place where a
:class:`~torchpass_slurm.errors.TorchpassError` becomes a message on stderr
and an exit code.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import click

from torchpass_slurm.errors import TorchpassError

if TYPE_CHECKING:
    from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])

#: Exit code for an error the program did not expect (a bug): the traceback is shown.
EXIT_INTERNAL = 70


class App:
    """State shared by all commands: verbosity and lazily built consoles."""

    def __init__(self, *, verbose: int = 0, quiet: bool = False) -> None:
        self.verbose = verbose
        self.quiet = quiet

    @cached_property
    def console(self) -> Console:
        from rich.console import Console

        return Console(highlight=False)

    @cached_property
    def err_console(self) -> Console:
        from rich.console import Console

        return Console(stderr=True, highlight=False)

    def configure_logging(self) -> None:
        level = logging.WARNING
        if self.verbose == 1:
            level = logging.INFO
        elif self.verbose >= 2:
            level = logging.DEBUG
        if self.quiet:
            level = logging.ERROR
        logging.basicConfig(
            level=level,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )


def pass_app(f: F) -> F:
    """Decorator: pass the :class:`App` from the click context as first argument."""

    @click.pass_context
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        app = ctx.find_object(App)
        if app is None:
            app = ctx.ensure_object(App)
        return ctx.invoke(f, app, *args, **kwargs)

    from functools import update_wrapper

    return update_wrapper(wrapper, f)  # type: ignore[return-value]


def render_error(err: TorchpassError) -> None:
    """Write one error to stderr, plainly: ``error: <message>`` then the hint."""
    click.echo(f"error: {err.message}", err=True)
    if err.hint:
        click.echo(f"  hint: {err.hint}", err=True)


def run_cli(command: click.Command, args: list[str] | None = None, prog_name: str | None = None) -> int:
    """Run a click command; turn package errors into one message and an exit code."""
    try:
        # With standalone_mode=False click returns ctx.exit(n)'s code instead of raising it.
        result = command.main(args=args, prog_name=prog_name, standalone_mode=False)
        if isinstance(result, int):
            return result
    except TorchpassError as err:
        render_error(err)
        return err.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as err:
        err.show()
        return err.exit_code
    except click.exceptions.Exit as err:
        return err.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. `tp events | head`): not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return 0
