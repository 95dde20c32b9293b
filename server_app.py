"""Flower ServerApp: resolve the experiment config, build the strategy, run it, write the results.

When it loads, this module imports Flower and the light part of the core only (config, protocol, results,
validation, message_sweep: no torch, ~0.1 s); whatever imports torch (the data, checkpoints, trackers, the node
description and the strategies, ~4 s) is imported inside the functions, when a run starts. Flower's simulation loads
the ServerApp (on its thread) and the ClientApp (on its main thread, which then starts Ray) under one import lock:
a light module lets Ray's processes boot while the run's imports happen (docs/performance.md, the start-up
benchmark).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedapps.config import ExperimentConfig, dump_yaml, load_config, split_overrides
from fedapps.flower import MessageGrid, message_sweep
from fedapps.importpath import check_own_modules
from fedapps.reporting.results import (
    REJECTIONS,
    DeliveryCheck,
    FileSink,
    ResultSink,
    UnusableRun,
    append_rejections,
    exit_status,
    run_problems,
)
from fedapps.wire import protocol
from fedapps.wire.validation import ReplyValidator, evaluation_share, registry_of

if TYPE_CHECKING:  # annotations only (fedapps.flower.describe imports torch)
    from fedapps.flower.describe import Description

log = logging.getLogger("fedapps")
app = ServerApp()


def setup_logging() -> None:
    """Progress lines of the fedapps logger go to the run's log (what `flwr run --stream` shows)."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s fedapps: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def set_server_threads() -> int:
    """Server-side torch threads (COSMOS trains models here): FEDAPPS_SERVER_THREADS, default 1.

    In simulation the ServerApp shares the cores with the client workers; a multi-threaded server process
    next to them was measured ~15x slower on 2 cores (oversubscription), so one thread is the safe default.
    """
    import torch  # see the module docstring

    threads = int(os.environ.get("FEDAPPS_SERVER_THREADS", "1"))
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


def run_experiment(
    grid: MessageGrid,
    config_path: str,
    overrides: str,
    output_dir: str,
    resume_dir: str = "",
    after_round: Callable[[int], Any] | None = None,
    keep_state: bool = False,
) -> dict:
    """Run one configured experiment on a Grid and return its summary (used by the ServerApp and tests).

    A new run's folder (``<output_dir>/<run name>``) must be new or empty (a used one is refused: ConfigError).
    After every round the results and ``checkpoint.pt`` are written to the run folder (then ``after_round(k)``
    is called). ``resume_dir``: a run folder with a checkpoint of the same config; the run continues after its
    last round, the rows of rounds.csv so far restored, the clients' private models read from its client-state/.
    A run that ends successfully removes its resume state (checkpoint.pt, client-state/, server-state/) unless
    ``keep_state``.
    """
    check_own_modules()  # a user's module named like ours (strategies) is said so, before it is imported instead
    # these import torch: when the run starts, not when Flower loads the module (the module docstring)
    from fedapps import checkpoint
    from fedapps.data import NODES, get_federation, set_described_counts, spec_key
    from fedapps.flower.describe import bind_accepted
    from fedapps.reporting import tracking
    from fedapps.server.driver import RoundDriver
    from strategies import RunContext, report_ignored, resolve

    setup_logging()
    set_server_threads()
    t0 = time.time()
    cfg = load_config(config_path, overrides)
    resolved = resolve(cfg)  # strategy.name and strategy.params checked here (ConfigError naming the key)
    report_ignored(cfg, split_overrides(overrides))  # keys set but not read by this run: a warning each
    cfg = resolved.config(cfg)  # config.yaml shows the chosen strategy's params with every default filled in
    saved = None
    if resume_dir:
        saved = checkpoint.load_checkpoint(resume_dir)
        cfg = nodes_as_checkpointed(cfg, saved["config"])
        checkpoint.check_same_config(saved["config"], dump_yaml(cfg), resume_dir)
    description = None
    if cfg.data.source == NODES:  # the nodes hold the data: ask them what it is before anything is built
        description, describe_validator = describe(grid, cfg, resolved.cls.needs_public_set)
        cfg = dataclasses.replace(
            cfg,
            data=dataclasses.replace(
                cfg.data, num_classes=description.num_classes, input_shape=list(description.input_shape)
            ),
        )
        set_described_counts(spec_key(dataclasses.asdict(cfg.data)), *description.counts(cfg.data.num_clients))
    if saved is not None:
        run_dir = Path(resume_dir).expanduser().resolve()
        files = FileSink(cfg, run_dir.parent, run_dir=run_dir)
        files.restore_rows(saved["rows"], int(saved["round"]))
        t0 -= float(saved.get("wall_seconds", 0.0))
    else:
        output_dir = output_dir or cfg.output_dir
        checkpoint.check_fresh(Path(output_dir).expanduser().resolve() / cfg.resolved_run_name())
        files = FileSink(cfg, output_dir)
    delivery = DeliveryCheck()  # a run with no usable reply, or mostly undelivered messages, fails below
    if saved is not None:  # its counts cover the whole run: the rounds before the checkpoint too
        vars(delivery).update(copy.deepcopy(saved.get("delivery", {})))
    sinks: list[ResultSink] = [files, delivery]
    if description is not None:
        files.write_partition(description.partition_rows(cfg.data.evaluate_on))
        append_rejections(files.dir / REJECTIONS, description.rejections)
    else:
        files.write_partition(get_federation(dataclasses.asdict(cfg.data)).stats_rows())
    log.info(
        "run '%s': strategy %s, data %s/%s, %d clients, %d rounds -> %s",
        cfg.resolved_run_name(),
        cfg.strategy.name,
        cfg.data.source,
        cfg.data.partition,
        cfg.data.num_clients,
        cfg.rounds,
        files.dir,
    )
    token = str(saved["run_token"]) if saved else uuid.uuid4().hex
    config_yaml = dump_yaml(cfg)

    def on_round(entry) -> None:
        for sink in sinks:
            sink.on_round(entry)
        checkpoint.save_checkpoint(
            files.dir,
            {
                "round": entry.round,
                "config": config_yaml,
                "strategy_name": resolved.name,
                "run_token": token,
                "state": driver.checkpoint_state(),
                "rows": files.rows,
                "wall_seconds": time.time() - t0,
                "delivery": copy.deepcopy(vars(delivery)),
            },
        )
        if after_round is not None:
            after_round(entry.round)

    context = RunContext(
        on_round=on_round,
        client_state=protocol.Bookkeeping(state_dir=str(files.dir / checkpoint.CLIENT_STATE), state_run=token),
        server_state_dir=str(files.dir / checkpoint.SERVER_STATE),
        excluded_nodes=frozenset(description.excluded) if description is not None else frozenset(),
    )
    strategy = resolved.build(cfg, context)
    driver = RoundDriver(strategy)  # the round loop around the strategy
    first_round = 1
    if saved is not None:
        driver.load_checkpoint_state(saved["state"])
        first_round = int(saved["round"]) + 1
        log.info("resuming '%s' after round %d of %d", files.dir, first_round - 1, cfg.rounds)
    if description is not None:  # after a checkpoint's bindings: the nodes described now are who they said
        bind_accepted(describe_validator, strategy.replies.validator, description)
    # experiment trackers (config key tracking), after the file sink: at the end they read the files it wrote
    trackers = tracking.tracking_sinks(cfg, files.dir, resumed=saved is not None)
    sinks.extend(trackers)
    try:
        driver.start(grid=grid, num_rounds=cfg.rounds, timeout=cfg.strategy.timeout, first_round=first_round)
    except BaseException as exc:  # the trackers mark their run failed; the error itself goes on
        tracking.abort(trackers, f"{type(exc).__name__}: {exc}")
        raise
    described = {"nodes": description.summary()} if description is not None else {}
    summary = files.summary(
        time.time() - t0,
        {
            **strategy.protocol_summary(),
            **strategy.final_summary(),
            # the run ended before cfg.rounds (a privacy budget): after which round, and why
            **({"stopped_early": dict(strategy.history.stopped)} if strategy.history.stopped else {}),
            **delivery.totals(),
            **described,
            "simulation_message_sweep": message_sweep.in_use(),
        },
    )
    # whether the result means something: what went wrong, in words, and the exit status it gives (fedapps run)
    found = run_problems(summary, files.rows, cfg.min_measured_share, delivery)
    problems = [p.text for p in found]
    summary.update({"problems": problems, "exit_status": exit_status(found)})
    artifacts = strategy.artifacts()
    for sink in sinks:
        sink.on_finish(summary, artifacts)
    log.info("RESULTS %s", files.dir)
    if summary.get("final_round_had_no_replies"):
        if summary.get("final_round") is None:
            log.warning("the last round got no usable reply, and no round measured an accuracy")
        else:
            log.warning(
                "the last round got no usable reply: the reported accuracy is from round %s",
                summary.get("final_round"),
            )
    if problems:  # results are on disk for inspection; the run itself fails (Flower: finished:failed)
        raise UnusableRun("; ".join(problems) + f" (results: {files.dir})", exit_status(found))
    if not keep_state:
        freed = checkpoint.remove_resume_state(files.dir)
        log.info(
            "run finished: its resume state (checkpoint, client-state/, server-state/; %.1f MiB) removed "
            "(keep it with --keep-state)",
            freed / (1024 * 1024),
        )
    return summary


def describe(grid: MessageGrid, cfg: ExperimentConfig, uses_public: bool) -> tuple[Description, ReplyValidator]:
    """data.source 'nodes': every connected node describes its data (:mod:`fedapps.flower.describe`); classes and shape
    are settled (pinned by data.num_classes / data.input_shape where given), refused nodes excluded. A strategy
    that ``uses_public`` U has each node's copy checked against the server's here, before round 1."""
    from fedapps.data import get_federation  # torch: see the module docstring
    from fedapps.flower.describe import describe_nodes

    d = cfg.data
    spec = dataclasses.asdict(d)
    setup = protocol.Setup(
        data=protocol.data_spec_for_clients(spec), model=protocol.ModelSpec(cfg.model.name, cfg.seed)
    )
    # the nodes' copies of U are checked against the server's before round 1
    public = protocol.PublicSet(fingerprint=get_federation(spec).fingerprint) if uses_public else protocol.PublicSet()
    validator = ReplyValidator(d.num_clients, registry=registry_of(d))  # the operator's caps bind before round 1
    # wait for the whole federation (strategy.expected_clients, default data.num_clients) before asking
    wanted = cfg.strategy.expected_clients or d.num_clients
    description = describe_nodes(
        grid,
        setup,
        d.num_clients,
        cfg.strategy.timeout,
        validator,
        pinned_classes=d.num_classes,
        pinned_shape=tuple(d.input_shape),
        wanted=wanted,
        wait_seconds=cfg.strategy.connect_timeout,
        public=public,
        eval_share=evaluation_share(d),
    )
    return description, validator


def nodes_as_checkpointed(cfg: ExperimentConfig, saved_yaml: str) -> ExperimentConfig:
    """A resumed data.source 'nodes' run: the classes and shape its nodes described (in the checkpointed config)
    are pinned, unless the given config pins its own."""
    from fedapps.data import NODES  # torch: see the module docstring

    if cfg.data.source != NODES or (cfg.data.num_classes and cfg.data.input_shape):
        return cfg
    saved = (yaml.safe_load(saved_yaml) or {}).get("data", {})
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data,
            num_classes=cfg.data.num_classes or int(saved.get("num_classes", 0) or 0),
            input_shape=list(cfg.data.input_shape or saved.get("input_shape", []) or []),
        ),
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point under `flwr run`: run config keys 'config', 'overrides', 'output-dir', 'resume-dir',
    'keep-state'."""
    message_sweep.poll_replies_often(grid)  # simulation: replies looked for every 0.02 s, not 0.1 s
    rc = context.run_config
    run_experiment(
        grid,
        str(rc.get("config", "configs/default.yaml")),
        str(rc.get("overrides", "")),
        str(rc.get("output-dir", "")),
        resume_dir=str(rc.get("resume-dir", "")),
        keep_state=str(rc.get("keep-state", "false")).lower() in ("true", "1"),
    )
