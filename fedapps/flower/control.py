"""Flower's Control API and CLI internals, for the ``fedapps`` command (:mod:`fedapps_tools.flwrcli`).

- :func:`gitignore_matcher`: Flower's own .gitignore matching (``flwr.cli.utils``), so that the files the command
  hands to Flower's FAB builder are the files `flwr run` itself would take.
- :func:`control_client`, :func:`run_status`, :func:`log_chunks`: what `flwr ls` / `flwr log` do, asked in this
  process from an insecure loopback SuperLink's Control API (no extra Python process next to the run's workers).

Each is gated on the checked Flower release (:func:`fedapps.flower.require_checked_flower`); the Control API
shortcut is an optimisation with a public fallback (the `flwr` commands), so there the gate reports "unavailable"
(None) instead of stopping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedapps.flower import installed_flwr, is_checked_release, require_checked_flower


def gitignore_matcher(root: Path) -> Callable[[str], bool] | None:
    """``match(relative_posix_path) -> bool`` for ``root/.gitignore`` as Flower reads it; None when the file has no
    patterns or has negations (``!``), which a pruning walk cannot honour."""
    require_checked_flower("Listing the app's files like `flwr run` (flwr.cli.utils)")
    from flwr.cli.utils import build_pathspec, load_gitignore_patterns

    patterns = load_gitignore_patterns(Path(root) / ".gitignore")
    if not patterns or any(p.startswith("!") for p in patterns):
        return None
    return build_pathspec(tuple(patterns)).match_file


def control_client(address: str) -> Any | None:
    """A client of the insecure loopback SuperLink at ``address``'s Control API; None when Flower's client classes
    cannot be used (another Flower release, or they cannot be imported): the caller then uses the `flwr` commands."""
    if not is_checked_release(installed_flwr()):
        return None
    try:
        from flwr.supercore.control import ControlHttpClient
        from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
    except ImportError:
        return None
    return ControlHttpClient.from_server_address(
        server_address=address,
        insecure=True,
        root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")],
    )


def run_status(client: Any, run_id: str) -> str:
    """The run's status as `flwr ls` shows it ("finished:completed", "running", ...)."""
    from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=no-name-in-module

    status = client.ListRuns(ListRunsRequest(run_id=int(run_id))).run_dict[int(run_id)].status
    return f"{status.status}:{status.sub_status}" if status.sub_status else str(status.status)


def log_chunks(client: Any, run_id: str) -> Iterator[str]:
    """The run's log output, chunk by chunk as the SuperLink streams it, until the stream ends."""
    from flwr.proto.control_pb2 import StreamLogsRequest  # pylint: disable=no-name-in-module

    for res in client.StreamLogs(StreamLogsRequest(run_id=int(run_id), after_timestamp=0.0)):
        yield res.log_output
