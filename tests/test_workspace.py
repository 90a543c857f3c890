"""Tests for `normlab compare --wandb`: the wandb workspace it builds (its spec: panels, grouping by arm, x and y
keys, project and group), saved with only the network call replaced, or written to report/wandb_workspace.json
offline."""

import json

import pytest

pytest.importorskip("wandb_workspaces")

from normlab.analysis import build_comparison, find_run_dirs  # noqa: E402
from normlab.analysis.render.workspace import build_workspace, spec, targets  # noqa: E402
from test_compare import run_compare_cli, write_run  # noqa: E402


def sweep(root, project="ablation", group="norm_2026-11-25_a81b2e", entity="team", seed=0):
    for norm in ("rms", "layer"):
        for lr in (1e-3, 3e-3):
            write_run(root / f"{norm}-{lr}", norm=norm, lr=lr, seed=seed,
                      extra_config={"wandb.project": project, "wandb.group": group, "wandb.entity": entity})
    return root


def panels(view_spec) -> dict:
    sections = view_spec["spec"]["section"]["panelBankConfig"]["sections"]
    return {s["name"]: [(p["viewType"], p["config"]) for p in s["panels"]] for s in sections}


def test_the_view_plots_val_loss_by_arm_loss_against_lr_stability_and_telemetry_for_the_runs_group(tmp_path):
    comparison = build_comparison(find_run_dirs([sweep(tmp_path / "sweep")]))
    [target] = targets(comparison)
    assert (target.entity, target.project, target.groups) == ("team", "ablation", ["norm_2026-11-25_a81b2e"])
    view = spec(build_workspace(comparison, target, "normlab compare: sweep"))
    assert (view["entity"], view["project"], view["displayName"]) == ("team", "ablation", "normlab compare: sweep")
    shown = panels(view)
    assert list(shown) == ["Answer", "Stability", "Telemetry"]
    (kind, curve), (scatter_kind, scatter) = shown["Answer"]
    assert kind == "Run History Line Plot" and curve["metrics"] == ["val_loss"] and curve["xAxis"] == "step"
    assert curve["groupBy"] == "arm.value" and curve["groupAgg"] == "mean" and curve["groupArea"] == "minmax"
    assert scatter_kind == "Scatter Plot" and scatter["xAxis"] == "config:lr.value"
    assert scatter["yAxis"] == "summary:final_val_loss" and scatter["xAxisLogScale"] is True
    assert [c["metrics"] for _, c in shown["Stability"]] == [["grad_norm"], ["loss"], ["lr"]]
    assert all(c["groupBy"] == "arm.value" for _, c in shown["Stability"])
    kinds = [k for k, _ in shown["Telemetry"]]
    assert kinds == ["Weave", "Media Browser"] and "telemetry/layers" in json.dumps(shown["Telemetry"][0][1])
    assert shown["Telemetry"][1][1]["mediaKeys"] == ["telemetry/resid_rms", "telemetry/grad_norm"]
    [runset] = view["spec"]["section"]["runSets"]
    assert runset["filters"]["filters"] == [{"key": {"section": "run", "name": "group"}, "op": "IN",
                                             "value": ["norm_2026-11-25_a81b2e"], "disabled": False}]
    assert runset["grouping"] == [{"section": "config", "name": "norm.value.label"}, {"section": "config", "name": "arm.value"}]


def test_offline_the_spec_goes_to_the_report_dir_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "r"
    assert run_compare_cli([str(sweep(tmp_path / "sweep")), "--out", str(out), "--wandb"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"wandb workspace not saved (WANDB_MODE=offline): its spec is in {out / 'wandb_workspace.json'}"
    [view] = json.loads((out / "wandb_workspace.json").read_text())
    assert view["project"] == "ablation" and list(panels(view)) == ["Answer", "Stability", "Telemetry"]


def test_with_a_key_the_view_is_saved_and_a_failed_save_falls_back_to_the_spec(tmp_path, capsys, monkeypatch):
    import wandb_workspaces.workspaces as ws

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    saved = []
    monkeypatch.setattr(ws.Workspace, "save", lambda self: saved.append(spec(self)) or self)  # the network call
    root = sweep(tmp_path / "sweep")
    sweep(tmp_path / "other", project="other", group="g2", seed=1)  # seed 0 again would repeat the first sweep's runs
    assert run_compare_cli([str(root), str(tmp_path / "other"), "--out", str(tmp_path / "r"), "--wandb"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "wandb workspace (2 views: the runs are in 2 wandb projects) saved in team/ablation, team/other"
    assert [(v["project"], panels(v)["Answer"][0][1]["metrics"]) for v in saved] == [("ablation", ["val_loss"]), ("other", ["val_loss"])]
    assert not (tmp_path / "r" / "wandb_workspace.json").exists()

    def refuse(self):
        raise ConnectionError("Max retries exceeded")

    monkeypatch.setattr(ws.Workspace, "save", refuse)
    assert run_compare_cli([str(root), "--out", str(tmp_path / "r"), "--wandb"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("wandb workspace not saved (saving failed (ConnectionError: Max retries exceeded)): its spec")
    assert json.loads((tmp_path / "r" / "wandb_workspace.json").read_text())[0]["project"] == "ablation"


def test_without_wandb_workspaces_wandb_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb_workspaces" else find_spec(name, *a))
    out = tmp_path / "r"
    assert run_compare_cli([str(sweep(tmp_path / "sweep")), "--out", str(out), "--wandb"]) == 2
    err = capsys.readouterr().err
    assert err == "normlab: error: --wandb needs the wandb-workspaces package: pip install 'normlab[workspace]'\n"
    assert not out.exists()
