"""One experiment on a Grid, from its prepared config to its summary (:class:`Experiment`): ``prepare`` (the run
folder, the nodes' description under data.source 'nodes', the strategy built with its run context), ``restore``
(a resumed run's rows, counts and loop state), ``on_round`` (every round's record to the sinks, then the checkpoint,
:class:`CheckpointPayload`) and ``finish`` (the summary, what went wrong, the resume state removed). The ServerApp
(``server_app.run_experiment``) runs it; the strategy registry is given (the core names no algorithm)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedapps import checkpoint
from fedapps.config import ExperimentConfig, dump_yaml
from fedapps.data import NODES, get_federation, set_described_counts, spec_key
from fedapps.flower import MessageGrid, message_sweep
from fedapps.flower.describe import Description, bind_accepted, describe_nodes
from fedapps.reporting import tracking
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
from fedapps.server.driver import RoundDriver
from fedapps.server.prepare import Registry, prepare_run
from fedapps.server.rounds import RoundLog
from fedapps.server.strategy import RunContext
from fedapps.wire import protocol
from fedapps.wire.validation import ReplyValidator, evaluation_share, registry_of

log = logging.getLogger("fedapps")


@dataclass
class CheckpointPayload:
    """What ``checkpoint.pt`` holds after a round: the round, the run's config (YAML) and strategy, its token (where
    clients find their state), the round loop's state (:meth:`RoundDriver.checkpoint_state`), the rows of rounds.csv,
    the wall time so far and the delivery counts."""

    round: int
    config: str
    strategy_name: str
    run_token: str
    state: dict[str, Any]
    rows: list[dict[str, Any]]
    wall_seconds: float = 0.0
    delivery: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> CheckpointPayload:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})


class Experiment:
    """One run of a prepared config on ``grid``: see the module docstring; :meth:`run` does it all."""

    def __init__(
        self,
        grid: MessageGrid,
        config_path: str,
        overrides: str,
        registry: Registry,
        output_dir: str = "",
        resume_dir: str = "",
        after_round: Callable[[int], Any] | None = None,
    ) -> None:
        self.grid = grid
        self.t0 = time.time()
        prepared = prepare_run(config_path, overrides, registry)
        self.cfg, self.resolved = prepared.cfg, prepared.strategy
        self.output_dir, self.resume_dir, self.after_round = output_dir, resume_dir, after_round
        self.saved = CheckpointPayload.from_dict(checkpoint.load_checkpoint(resume_dir)) if resume_dir else None
        self.description: Description | None = None
        self.delivery = DeliveryCheck()  # a run with no usable reply, or mostly undelivered messages, fails
        self.sinks: list[ResultSink] = []

    def run(self, keep_state: bool = False) -> dict:
        """prepare, restore, the rounds, finish: the run's summary."""
        self.prepare()
        first_round = self.restore()
        trackers = tracking.tracking_sinks(self.cfg, self.files.dir, resumed=self.saved is not None)
        self.sinks.extend(trackers)  # after the file sink: at the end they read the files it wrote
        try:
            self.driver.start(self.grid, self.cfg.rounds, self.cfg.strategy.timeout, first_round)
        except BaseException as exc:  # the trackers mark their run failed; the error itself goes on
            tracking.abort(trackers, f"{type(exc).__name__}: {exc}")
            raise
        return self.finish(keep_state)

    def prepare(self) -> None:
        """The run folder and its sinks, the nodes' description (data.source 'nodes'), the strategy and its driver."""
        cfg, saved = self.cfg, self.saved
        if saved is not None:
            cfg = nodes_as_checkpointed(cfg, saved.config)
            checkpoint.check_same_config(saved.config, dump_yaml(cfg), self.resume_dir)
        self.describe_validator: ReplyValidator | None = None
        if cfg.data.source == NODES:  # the nodes hold the data: ask them what it is before anything is built
            self.description, self.describe_validator = describe(self.grid, cfg, self.resolved.cls.needs_public_set)
            d = self.description
            data = dataclasses.replace(cfg.data, num_classes=d.num_classes, input_shape=list(d.input_shape))
            cfg = dataclasses.replace(cfg, data=data)
            set_described_counts(spec_key(dataclasses.asdict(cfg.data)), *d.counts(cfg.data.num_clients))
        self.cfg = cfg
        if saved is not None:
            run_dir = Path(self.resume_dir).expanduser().resolve()
            self.files = FileSink(cfg, run_dir.parent, run_dir=run_dir)
            self.files.restore_rows(saved.rows, int(saved.round))  # before the nodes' rejections are appended
        else:
            output_dir = self.output_dir or cfg.output_dir
            checkpoint.check_fresh(Path(output_dir).expanduser().resolve() / cfg.resolved_run_name())
            self.files = FileSink(cfg, output_dir)
        self.sinks = [self.files, self.delivery]
        if self.description is not None:
            self.files.write_partition(self.description.partition_rows(cfg.data.evaluate_on))
            append_rejections(self.files.dir / REJECTIONS, self.description.rejections)
        else:
            self.files.write_partition(get_federation(dataclasses.asdict(cfg.data)).stats_rows())
        log.info(
            "run '%s': strategy %s, data %s/%s, %d clients, %d rounds -> %s",
            *(cfg.resolved_run_name(), cfg.strategy.name, cfg.data.source, cfg.data.partition),
            *(cfg.data.num_clients, cfg.rounds, self.files.dir),
        )
        self.token = str(saved.run_token) if saved is not None else uuid.uuid4().hex
        self.config_yaml = dump_yaml(cfg)
        context = RunContext(
            on_round=self.on_round,
            client_state=protocol.Bookkeeping(
                state_dir=str(self.files.dir / checkpoint.CLIENT_STATE), state_run=self.token
            ),
            server_state_dir=str(self.files.dir / checkpoint.SERVER_STATE),
            excluded_nodes=frozenset(self.description.excluded) if self.description is not None else frozenset(),
        )
        self.strategy = self.resolved.build(cfg, context)
        self.driver = RoundDriver(self.strategy)  # the round loop around the strategy

    def restore(self) -> int:
        """A resumed run: its wall time, delivery counts and loop state back (its rows: :meth:`prepare`); the nodes
        described bound to their clients; the first round to run."""
        saved, first_round = self.saved, 1
        if saved is not None:
            self.t0 -= float(saved.wall_seconds)
            vars(self.delivery).update(copy.deepcopy(saved.delivery))  # its counts cover the rounds before too
            self.driver.load_checkpoint_state(saved.state)
            first_round = int(saved.round) + 1
            log.info("resuming '%s' after round %d of %d", self.files.dir, first_round - 1, self.cfg.rounds)
        if (
            self.description is not None and self.describe_validator is not None
        ):  # after a checkpoint's bindings: the nodes described now are who they said
            bind_accepted(self.describe_validator, self.strategy.replies.validator, self.description)
        return first_round

    def on_round(self, entry: RoundLog) -> None:
        """A round's record to every sink, then the checkpoint (then ``after_round``)."""
        for sink in self.sinks:
            sink.on_round(entry)
        payload = CheckpointPayload(
            round=entry.round,
            config=self.config_yaml,
            strategy_name=self.resolved.name,
            run_token=self.token,
            state=self.driver.checkpoint_state(),
            rows=self.files.rows,
            wall_seconds=time.time() - self.t0,
            delivery=copy.deepcopy(vars(self.delivery)),
        )
        checkpoint.save_checkpoint(self.files.dir, payload.as_dict())
        if self.after_round is not None:
            self.after_round(entry.round)

    def finish(self, keep_state: bool) -> dict:
        """The summary and artefacts to every sink; an unusable run raised (its results stay); the resume state
        removed unless ``keep_state``."""
        strategy, files, d = self.strategy, self.files, self.description
        summary = files.summary(
            time.time() - self.t0,
            {
                **strategy.protocol_summary(),
                **strategy.final_summary(),
                # the run ended before cfg.rounds (a privacy budget): after which round, and why
                **({"stopped_early": dict(strategy.history.stopped)} if strategy.history.stopped else {}),
                **self.delivery.totals(),
                **({"nodes": d.summary()} if d is not None else {}),
                "simulation_message_sweep": message_sweep.in_use(),
            },
        )
        # whether the result means something: what went wrong, in words, and the exit status it gives (fedapps run)
        found = run_problems(summary, files.rows, self.cfg.min_measured_share, self.delivery)
        problems = [p.text for p in found]
        summary.update({"problems": problems, "exit_status": exit_status(found)})
        artifacts = strategy.artifacts()
        for sink in self.sinks:
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
    d = cfg.data
    spec = dataclasses.asdict(d)
    setup = protocol.Setup(
        data=protocol.data_spec_for_clients(spec), model=protocol.ModelSpec(cfg.model.name, cfg.seed)
    )
    # the nodes' copies of U are checked against the server's before round 1
    public = protocol.PublicSet(fingerprint=get_federation(spec).fingerprint) if uses_public else protocol.PublicSet()
    validator = ReplyValidator(d.num_clients, registry=registry_of(d))  # the operator's caps bind before round 1
    description = describe_nodes(
        grid,
        setup,
        d.num_clients,
        cfg.strategy.timeout,
        validator,
        pinned_classes=d.num_classes,
        pinned_shape=tuple(d.input_shape),
        wanted=cfg.strategy.expected_clients or d.num_clients,  # the whole federation (default data.num_clients)
        wait_seconds=cfg.strategy.connect_timeout,
        public=public,
        eval_share=evaluation_share(d),
    )
    return description, validator


def nodes_as_checkpointed(cfg: ExperimentConfig, saved_yaml: str) -> ExperimentConfig:
    """A resumed data.source 'nodes' run: the classes and shape its nodes described (in the checkpointed config)
    are pinned, unless the given config pins its own."""
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
