"""`normlab compare ... --wandb`: the comparison's view as a saved wandb workspace (wandb-workspaces).

The view holds the report's answer in wandb's own panels, for the wandb project and group of the
compared runs (their config.json's wandb section): the validation loss against step grouped by arm;
the final validation loss against lr, the runs coloured by norm (the runset is grouped by
`norm.label`, then `arm`); the stability keys (grad_norm, the training loss whose spikes the report counts, lr);
and the telemetry the runs logged at their end (the `telemetry/layers` table and the
`telemetry/resid_rms` and `telemetry/grad_norm` heatmaps). Runs of several projects get a view
each. Without network or an API key (or when saving fails) the views' spec is written to
`<report dir>/wandb_workspace.json` instead.

wandb-workspaces is an optional extra (`pip install 'normlab[workspace]'`), imported only here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.analysis.stats.comparison import Comparison
from normlab.analysis.read.runs import CONFIG, CompareError

EXTRA = "pip install 'normlab[workspace]'"  # what --wandb needs installed
SPEC = "wandb_workspace.json"  # the views' spec, where --wandb cannot save them to wandb
DEFAULT_PROJECT = "normlab"  # the project a run without wandb.project or WANDB_PROJECT went to (sinks/wandb.py)


@dataclass
class Target:
    """Where a view goes: a wandb entity (None: the account's default) and project, and the runs' groups."""

    entity: str | None
    project: str
    groups: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the runs' names, for runs without a group


def targets(comparison: Comparison) -> list[Target]:
    """A Target per (entity, project) of the compared runs, from their config.json's wandb section (a null project
    is WANDB_PROJECT, else normlab's default, as the run's wandb sink chose), sorted."""
    found: dict[tuple, Target] = {}
    for run in comparison.runs:
        section = _wandb_section(run.path)
        project = section.get("project") or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        entity = section.get("entity") or os.environ.get("WANDB_ENTITY") or None
        target = found.setdefault((entity, project), Target(entity, project))
        group = section.get("group")
        if group and group not in target.groups:
            target.groups.append(group)
        elif not group:
            target.names.append(str(run.summary.get("name") or run.path.name))
    return [found[key] for key in sorted(found, key=lambda key: (key[0] or "", key[1]))]


def _wandb_section(run_dir: Path) -> dict[str, Any]:
    try:
        section = json.loads((run_dir / CONFIG).read_text()).get("wandb")
    except (OSError, ValueError, AttributeError):
        return {}
    return section if isinstance(section, dict) else {}


def build_workspace(comparison: Comparison, target: Target, title: str):
    """The wandb_workspaces Workspace of the comparison for `target` (not saved)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    by_arm = dict(groupby=wr.Config("arm"), groupby_aggfunc="mean", groupby_rangefunc="minmax")

    def line(key: str, title: str, log_y: bool = False):
        return wr.LinePlot(title=title, x="step", y=[key], log_y=log_y or None, **by_arm)

    measure = comparison.measure  # val_bpb when the runs' tokenizers differ
    sections = [
        ws.Section(name="Answer", is_open=True, panels=[
            line(measure, f"{measure} against step, by arm (mean, min–max over seeds)"),
            wr.ScatterPlot(title=f"final {measure} against lr, by norm", x=wr.Config("lr"),
                           y=wr.SummaryMetric(f"final_{measure}"), log_x=True),
        ]),
        ws.Section(name="Stability", is_open=True, panels=[
            line("grad_norm", "grad_norm (before clipping) against step, by arm", log_y=True),
            line("loss", "training loss against step, by arm (spikes)"),
            line("lr", "learning rate against step, by arm"),
        ]),
        ws.Section(name="Telemetry", is_open=True, panels=[
            wr.WeavePanelSummaryTable(table_name="telemetry/layers"),
            wr.MediaBrowser(title="layer × step heatmaps", media_keys=["telemetry/resid_rms", "telemetry/grad_norm"],
                            gallery_axis="run"),
        ]),
    ]  # fmt: skip
    if target.groups:
        runs = ws.Metric("Group").isin(target.groups)
    else:
        runs = ws.Metric("Name").isin(target.names)
    return ws.Workspace(
        entity=target.entity or "", project=target.project, name=title, sections=sections,
        settings=ws.WorkspaceSettings(x_axis="step", max_runs=max(10, len(comparison.runs))),
        runset_settings=ws.RunsetSettings(filters=ws.And(runs), groupby=[ws.Config("norm.label"), ws.Config("arm")]),
    )  # fmt: skip


def spec(workspace) -> dict[str, Any]:
    """The workspace as JSON data: its view model as wandb would store it (the model's model_dump, by alias)."""
    return json.loads(workspace._to_model().model_dump_json(by_alias=True, exclude_none=True))


def save_workspaces(comparison: Comparison, report_dir: Path, title: str) -> str:
    """Build a view per target and save each to wandb; where that cannot be done (no network, no API key,
    an error from wandb), write every view's spec to `report_dir`/wandb_workspace.json. Returns one line
    saying which. CompareError (one line) when wandb-workspaces is not installed."""
    check_installed()
    views = [(target, build_workspace(comparison, target, title)) for target in targets(comparison)]
    several = f" ({len(views)} views: the runs are in {len(views)} wandb projects)" if len(views) > 1 else ""
    reason = _why_offline()
    if reason is None:
        try:
            saved = [_save(workspace) for _, workspace in views]
            return f"wandb workspace{several} saved in " + ", ".join(saved)
        except Exception as err:  # wandb's errors are many (HTTP, GraphQL, auth): each means the same here
            reason = f"saving failed ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})"
    path = report_dir / SPEC
    path.write_text(json.dumps([spec(workspace) for _, workspace in views], indent=1, default=str) + "\n")
    return f"wandb workspace not saved ({reason}): its spec{several} is in {path}"


def check_installed() -> None:
    """CompareError, one line naming the extra to install, when wandb-workspaces is not installed."""
    import importlib.util

    if importlib.util.find_spec("wandb_workspaces") is None:
        raise CompareError(f"--wandb needs the wandb-workspaces package: {EXTRA}")


def _why_offline() -> str | None:
    """Why no view can be saved now (offline mode, no API key); None when wandb may be reached."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return f"WANDB_MODE={os.environ['WANDB_MODE']}"
    if os.environ.get("WANDB_API_KEY"):
        return None
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        if netrc.netrc().authenticators(host or ""):  # where `wandb login` keeps the key
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return "no wandb API key: run `wandb login`, or set WANDB_API_KEY"


def _save(workspace) -> str:
    """Save `workspace` to wandb (the one network call; wandb prints the view's URL), under the account's
    default entity when the runs named none; returns `entity/project`."""
    if not workspace.entity:
        import wandb

        workspace.entity = wandb.Api(timeout=10).default_entity
    workspace.save()
    return f"{workspace.entity}/{workspace.project}"
