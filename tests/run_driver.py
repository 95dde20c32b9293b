"""Test driver (not a test): run one experiment in-process in THIS process, as a subprocess of a test.

    python tests/run_driver.py CONFIG OUTPUT_DIR [RESUME_DIR]

FEDAPPS_TEST_KILL_AFTER_ROUND=k: SIGKILL this process right after round k's checkpoint is written (a crash
with no chance to clean up). Read here, never by library code.
"""

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(1)

import server_app  # noqa: E402
from fedapps.config import load_config  # noqa: E402
from fedapps.flower.inprocess import InProcessGrid  # noqa: E402


def main() -> None:
    config, output_dir = sys.argv[1], sys.argv[2]
    resume = sys.argv[3] if len(sys.argv) > 3 else ""
    kill_after = int(os.environ.get("FEDAPPS_TEST_KILL_AFTER_ROUND", "0") or 0)

    def after_round(rnd: int) -> None:
        if rnd == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    cfg = load_config(config)
    server_app.run_experiment(
        InProcessGrid(cfg.data.num_clients), config, "", output_dir, resume_dir=resume, after_round=after_round
    )


if __name__ == "__main__":
    main()
