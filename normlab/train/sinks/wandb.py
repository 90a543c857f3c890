"""The `wandb` sink (WandbSink): one wandb run per normlab run, the user's own wandb settings, and the
config as wandb shows it."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any

from normlab import keys
from normlab.train.sinks.base import Sink, SinkContext
from normlab.train.sinks.rundir import RunDir

log = logging.getLogger("normlab")


class WandbUnavailable(RuntimeError):
    """An online wandb run could not start (no network, no API key) and wandb.on_unreachable=stop; one line."""


# Keys whose wandb summary is the best (min) value and the final one.
MINIMIZED = ("val_loss", "val_bpb")


class WandbSink(Sink):
    """One wandb run per normlab run; offline unless the user's wandb settings or the config say otherwise.

    What the user set in wandb's own way (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_ID,
    WANDB_RESUME, a `wandb agent`'s run, `wandb offline`/`wandb online`) applies unless the config
    sets the same thing (a non-null wandb.mode, wandb.project, wandb.entity). An online run that
    cannot start within wandb.init_timeout seconds either records offline, with one warning, or
    raises WandbUnavailable, as wandb.on_unreachable says.
    """

    def __init__(self, wandb_cfg, run_dir: RunDir, name: str, config: dict[str, Any], tags: list[str],
                 run_id: str | None = None, history: list[dict[str, Any]] | None = None):
        """`run_id`: the wandb run's id (WANDB_RUN_ID wins over it). `history`: when resuming, the records
        the run already holds.

        A resumed run continues the same id. Online, wandb resumes after the run's last recorded
        step; offline, wandb 0.31 ignores `resume` and starts a new offline-run-*-<id> dir, which
        `wandb sync` uploads after the earlier ones as the same run. Either way wandb drops a step
        lower than one it already has, so the history is replayed from the run's current step
        (0 offline): steps an earlier, killed process never got to wandb are filled in, none twice.
        """
        import wandb  # slow to import, and only runs with the wandb sink need it

        self._wandb = wandb
        self._layers = wandb_cfg.layers
        user = user_wandb_settings()
        given = user.model_fields_set
        kwargs = dict(
            id=user.run_id if "run_id" in given else run_id,
            resume=user.resume if "resume" in given else None if history is None else "allow",
            project=wandb_cfg.project or (user.project if "project" in given else "normlab"),
            entity=wandb_cfg.entity or (user.entity if "entity" in given else None),
            group=wandb_cfg.group,
            job_type="train",
            name=name,
            tags=sorted(set(tags) | set(wandb_cfg.tags)),
            config=config,
            dir=str(run_dir.path),
            mode=wandb_cfg.mode or (user.mode if "mode" in given else "offline"),
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", init_timeout=wandb_cfg.init_timeout,
                                    login_timeout=wandb_cfg.init_timeout),
        )
        self.run = self._init(kwargs, wandb_cfg.on_unreachable)
        self._define_metrics()
        self._step: int | None = None
        for record in history or []:
            if record.get("step", -1) >= self.run.step:
                self.log(record)

    def _init(self, kwargs: dict[str, Any], on_unreachable: str):
        """wandb.init(**kwargs); an online run that cannot start records offline, or raises WandbUnavailable."""
        try:
            return self._wandb.init(**kwargs)
        except self._wandb.errors.Error as err:  # UsageError: no API key; CommError: no network, timed out
            if kwargs["mode"] in ("offline", "dryrun"):  # nothing to reach: a fault of its own
                raise
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if on_unreachable == "stop":
            raise WandbUnavailable(
                f"wandb could not start an online run ({reason}); set wandb.on_unreachable=offline to record "
                "offline and `wandb sync` later, or wandb.mode=offline"
            )
        log.warning("wandb could not start an online run (%s): recording offline under %s/wandb; "
                    "`wandb sync` uploads it later", reason, kwargs["dir"])
        # wandb's service still holds the failed run's id; a fresh service lets the offline run keep it.
        self._wandb.teardown()
        return self._wandb.init(**{**kwargs, "mode": "offline"})

    def _define_metrics(self) -> None:
        """`step` is every key's x-axis (`tokens` may be chosen instead); val_loss and val_bpb are summarised
        by their minimum and their last value."""
        self.run.define_metric("step")
        self.run.define_metric("tokens")
        self.run.define_metric("*", step_metric="step")
        for key in MINIMIZED:
            self.run.define_metric(key, step_metric="step", summary="min,last")

    @classmethod
    def open(cls, run: SinkContext) -> Sink:
        """The wandb run for `run`; a do-nothing sink when wandb is disabled (wandb.mode or WANDB_MODE)."""
        cfg = run.cfg
        if (cfg.wandb.mode or user_wandb_settings().mode) == "disabled":
            return Sink()
        tags = [f"norm={cfg.norm.label}", f"placement={cfg.placement}", f"qk_norm={str(cfg.qk_norm).lower()}"]
        history = run.history if run.start_step is not None else None
        return cls(cfg.wandb, run.run_dir, run.name, wandb_config(cfg, run.run_dir), tags, run_id=run.run_id,
                   history=history)

    def log(self, record: dict[str, Any]) -> None:
        self._step = record.get("step")
        if not self._layers:
            record = {k: v for k, v in record.items() if keys.parse(k) is None}
        self.run.log(record, step=self._step)

    # Tables and images join the last record's step, so end-of-run products do not add steps to the run.
    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self._wandb.Table(columns=columns, data=rows)}, step=self._step)

    def log_image(self, name: str, png: bytes) -> None:
        from PIL import Image  # only for end-of-run images, and only in wandb

        self.run.log({name: self._wandb.Image(Image.open(io.BytesIO(png)))}, step=self._step)

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        try:
            self.run.summary.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
            if summary.get("status") == "preempted":
                self.run.mark_preempting()
        finally:
            self.run.finish(exit_code=exit_code)


def user_wandb_settings():
    """wandb's settings as the user made them outside normlab: its settings files (`wandb offline`) and
    WANDB_* environment variables. `model_fields_set` names the ones that were set."""
    import wandb  # slow to import, and only runs with the wandb sink need it

    # Where `wandb offline` writes, as wandb.setup finds it.
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb").expanduser()
    settings = wandb.Settings(silent=True, settings_system=str(config_dir / "settings"))
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    return settings


def wandb_config(cfg, run_dir: RunDir) -> dict[str, Any]:
    """The run's config as wandb shows it: RunConfig's sections, plus what one groups and filters runs by
    (`arm`, `norm.label`), the run dir and the command line's overrides; without the wandb section
    (its facts are the run's own) and the schema's placeholder `name`."""
    config = cfg.to_dict()
    config.pop("name", None)
    overrides = config.pop("wandb")["overrides"]
    config["norm"]["label"] = cfg.norm.label
    config.update(arm=cfg.label, run_dir=str(run_dir.path.resolve()), overrides=" ".join(overrides))
    return config
