"""What `fedapps` prints when a run, comparison or tuning is interrupted (Ctrl-C or SIGTERM): the command that goes on
from where it stopped, to copy as printed.

- ``fedapps run``: the same command with ``--resume <run folder>`` when the run checkpointed a round (every ``--set``,
  ``--engine`` and ``--output-dir`` kept: a resumed run must have the same config); otherwise the same command again
  with ``--overwrite`` (the partial run folder would be refused by a new run).
- ``fedapps compare`` / ``fedapps tune``: the same command again: finished runs are reused and an interrupted run
  resumes from its checkpoint.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from fedapps.checkpoint import CHECKPOINT


def without_resume(argv: Sequence[str]) -> list[str]:
    """``argv`` without a ``--resume DIR`` / ``--resume=DIR`` it held."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--resume":
            skip = True
            continue
        if token.startswith("--resume="):
            continue
        out.append(token)
    return out


def resume_command(argv: Sequence[str], run_dir: Path | None) -> tuple[str, bool]:
    """(the command to go on, whether it resumes a checkpoint) for the interrupted ``fedapps <argv>``; ``run_dir``:
    the run folder of a ``fedapps run`` (None for compare and tune, or where it could not be told)."""
    args = list(argv)
    if args[:1] == ["run"] and run_dir is not None:
        if (run_dir / CHECKPOINT).is_file():
            return shlex.join(["fedapps", *without_resume(args), "--resume", str(run_dir)]), True
        if run_dir.is_dir() and any(run_dir.iterdir()):  # a new run refuses a used folder: --overwrite replaces it
            again = without_resume(args)
            return shlex.join(["fedapps", *again, *([] if "--overwrite" in again else ["--overwrite"])]), False
    return shlex.join(["fedapps", *args]), args[:1] in (["compare"], ["tune"])


def message(argv: Sequence[str], run_dir: Path | None) -> str:
    """The lines printed after "interrupted": how to go on."""
    command, resumes = resume_command(argv, run_dir)
    if list(argv[:1]) == ["run"]:
        if resumes:
            return f"its checkpoint is in {run_dir}; resume the run from its last finished round with:\n  {command}"
        return f"no round was checkpointed; start it again with:\n  {command}"
    return f"finished runs are kept and an interrupted one resumes; go on with:\n  {command}"
