"""What a `fedapps` command shows of its own log and of a run's streamed log.

- Flower's notes that say nothing about a run `fedapps` starts (it always sizes the federation itself) are left
  out, each by its exact text (:data:`FLOWER_NOISE`); any other Flower line, warnings included, is shown.
- A warning about the config or the data (loggers ``fedapps.config`` and ``fedapps.data``: the same however often
  the config is checked) is printed once per command: by this process's checks, and not again when the ServerApp
  of each run logs it (its lines come back through the streamed log).

Every streamed line is still kept, unfiltered, for the failure report (:class:`fedapps_tools.flwrcli.LogStream`).
"""

from __future__ import annotations

import logging
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LEVEL = r"(DEBUG|INFO|WARNING|ERROR|CRITICAL)"
FLOWER_LINE = re.compile(rf"{LEVEL} *: *(.*)")  # Flower's own format: "WARNING :   message"
FEDAPPS_LINE = re.compile(rf"{LEVEL} fedapps: (.*)")  # the ServerApp's (server_app.setup_logging)
PROCESS_PREFIX = re.compile(r"\([A-Za-z_]+ pid=\d+(?:, ip=[^)]*)?\) ?")  # Ray: "(ClientAppActor pid=123) "

# (level, exact message) of Flower's lines that `fedapps run` leaves out: notes about defaults and commands that a
# run started by fedapps does not use (it passes num-supernodes itself: --supernodes, default data.num_clients), and
# the routine steps of every simulation's start and end
FLOWER_NOISE: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("WARNING", re.compile(r"Since flwr 1\.32, default simulated SuperNodes changed from 10 to 2\.")),
    ("INFO", re.compile(r"To change federation size, use the following command:")),
    ("INFO", re.compile(r"flwr federation simulation-config \S+ <superlink> --num-supernodes <N>")),
    ("INFO", re.compile(r"")),  # Flower's empty separator line
    ("WARNING", re.compile(r"Manually terminating ClientAppActor")),  # each client actor at the simulation's end
    ("", re.compile(r"Successfully installed \S+ to \S+\.")),  # the app unpacked in the run's own FLWR_HOME
)
ONCE_LOGGERS = ("fedapps.config", "fedapps.data")  # warnings about the config and the data: printed once


def for_output(line: str, terminal: bool) -> str:
    """A streamed log line as written to the command's output: Flower's ANSI colour codes kept on a terminal only
    (a log file or a pipe gets plain text)."""
    return line if terminal else ANSI.sub("", line)


def parse_line(line: str) -> tuple[str, str]:
    """``(level, message)`` of one log line, without colour codes, a Ray process prefix or the level prefix
    (level '' for a line that has none)."""
    text = ANSI.sub("", line).rstrip("\r\n")
    text = text[m.end() :] if (m := PROCESS_PREFIX.match(text)) else text
    for pattern in (FEDAPPS_LINE, FLOWER_LINE):
        if m := pattern.fullmatch(text):
            return m.group(1), m.group(2).strip()
    return "", text.strip()


def is_flower_noise(level: str, message: str) -> bool:
    """One of :data:`FLOWER_NOISE`, matched on its level and its whole text."""
    return any(level == lv and pattern.fullmatch(message) for lv, pattern in FLOWER_NOISE)


class LogFilter:
    """Which lines a command shows: Flower's noise never, a config/data warning once (see the module docstring)."""

    def __init__(self) -> None:
        self.shown_once: set[str] = set()  # messages of config/data warnings printed so far
        self.repeats = 0  # lines left out because they repeated such a warning

    def first_time(self, message: str) -> bool:
        """Note a config/data warning about to be printed; False when it was printed before."""
        if message in self.shown_once:
            self.repeats += 1
            return False
        self.shown_once.add(message)
        return True

    def show(self, line: str) -> bool:
        """Whether a line of a run's streamed log is shown."""
        level, message = parse_line(line)
        if is_flower_noise(level, message):
            return False
        if message and message in self.shown_once and level in ("WARNING", ""):
            self.repeats += 1
            return False
        return True


class CommandLogHandler(logging.Handler):
    """The ``fedapps`` logger's output in a command: ``LEVEL fedapps: message`` on the current sys.stderr (the
    ServerApp's format, so that in-process and streamed lines read alike), config/data warnings once."""

    def __init__(self, log_filter: LogFilter) -> None:
        super().__init__()
        self.log_filter = log_filter
        self.setFormatter(logging.Formatter("%(levelname)s fedapps: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if (
                record.levelno == logging.WARNING
                and record.name.startswith(ONCE_LOGGERS)
                and not self.log_filter.first_time(record.getMessage())
            ):
                return
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never break the command (logging.Handler's own rule)
            self.handleError(record)


def command_logging(log_filter: LogFilter) -> CommandLogHandler:
    """Route the ``fedapps`` logger through one :class:`CommandLogHandler` holding ``log_filter``: it takes the place
    of a plain stderr handler an in-process ServerApp installed earlier in this process (which would print every
    line a second time), and one installed by an earlier command gets the new filter; returns the handler."""
    log = logging.getLogger("fedapps")
    for handler in list(log.handlers):
        if isinstance(handler, CommandLogHandler):
            handler.log_filter = log_filter
            return handler
        if type(handler) is logging.StreamHandler:  # server_app.setup_logging's; a FileHandler etc. stays
            log.removeHandler(handler)
    handler = CommandLogHandler(log_filter)
    log.addHandler(handler)
    return handler
