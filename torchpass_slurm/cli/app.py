"""The application object shared by every command, and the error boundary.

Every command receives an :class:`App` through the click context
(``@pass_app``). :func:`run_cli` is the only place where an error becomes a
message on stderr and an exit code:

- a :class:`~torchpass_slurm.errors.TorchpassError` is shown as ``error:``
  and its hint, and exits with the error's code;
- any other exception is a bug: one line says what happened and where its
  traceback was written (:func:`write_traceback`), and the exit code is
  :data:`EXIT_INTERNAL`. With ``--debug`` the traceback is on stderr too.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from torchpass_slurm import __version__
from torchpass_slurm.errors import TorchpassError

if TYPE_CHECKING:
    from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])

#: Exit code for an error the program did not expect (a bug), as sysexits' EX_SOFTWARE.
EXIT_INTERNAL = 70

#: The folder under the user's cache folder where tracebacks of internal errors go.
LOG_FOLDER = "torchpass-slurm"


class App:
    """State shared by all commands: verbosity, ``--debug`` and lazily built consoles."""

    def __init__(self, *, verbose: int = 0, quiet: bool = False, debug: bool = False) -> None:
        self.verbose = verbose
        self.quiet = quiet
        #: show the traceback of an internal error on stderr (``--debug``)
        self.debug = debug

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

    return cast(F, update_wrapper(wrapper, f))  # functools types the wrapper, not F


def render_error(err: TorchpassError) -> None:
    """Write one error to stderr, plainly: ``error: <message>`` then the hint."""
    click.echo(f"error: {err.message}", err=True)
    if err.hint:
        click.echo(f"  hint: {err.hint}", err=True)


def log_folders() -> list[Path]:
    """Where a traceback may go, in order: ``$XDG_CACHE_HOME`` (default ``~/.cache``), then ``$TMPDIR``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(cache) / LOG_FOLDER, Path(tempfile.gettempdir())]


def write_traceback(err: BaseException, prog: str, argv: Sequence[str]) -> Path | None:
    """Write ``err``'s traceback, with the command line and versions, to a new log file; its path.

    None when no folder of :func:`log_folders` can be written.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    text = "".join(
        [
            f"{prog}: internal error at {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n",
            f"command: {' '.join([prog, *argv])}\n",
            f"torchpass-slurm {__version__}, Python {platform.python_version()}, {platform.platform()}\n\n",
            *traceback.format_exception(type(err), err, err.__traceback__),
        ]
    )
    for folder in log_folders():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f"{prog}-{stamp}-", suffix=".log", dir=folder)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except OSError:
            continue
        return Path(name)
    return None


def render_internal_error(err: Exception, prog: str, argv: Sequence[str], *, debug: bool) -> int:
    """A bug reached the boundary: the traceback to a log file (and stderr with ``debug``), one line, 70."""
    if debug:
        click.echo("".join(traceback.format_exception(type(err), err, err.__traceback__)), err=True, nl=False)
    log = write_traceback(err, prog, argv)
    what = (str(err).splitlines() or [""])[0]
    seen = f"{type(err).__name__}: {what}" if what else type(err).__name__
    where = (
        f"the traceback is in {log}"
        if log is not None
        else f"the traceback could not be written ({', '.join(map(str, log_folders()))}); rerun with --debug"
    )
    click.echo(f"error: internal error in {prog} (a bug, please report it): {seen}; {where}", err=True)
    return EXIT_INTERNAL


def run_cli(command: click.Command, args: list[str] | None = None, prog_name: str | None = None) -> int:
    """Run a click command; turn errors into one message and an exit code (see the module's docstring)."""
    app = App()
    try:
        # With standalone_mode=False click returns ctx.exit(n)'s code instead of raising it.
        result = command.main(args=args, prog_name=prog_name, standalone_mode=False, obj=app)
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
    except Exception as err:  # deliberately broad: the boundary, where a bug is reported once
        argv = sys.argv[1:] if args is None else args
        return render_internal_error(err, prog_name or command.name or "tp", argv, debug=app.debug)
    return 0
