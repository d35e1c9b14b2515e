"""`perfscope analyze`: the terminal report and the documented, stable --json format."""

from __future__ import annotations

import json

import pytest
from storegen import DEFAULT_PHASES, MS, make_run

from perfscope.analysis import run_analysis
from perfscope.cli import main
from perfscope.commands.analyze import JSON_FORMAT_VERSION
from perfscope.store.open import open_store


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    for n in (1, 2, 4, 8):
        make_run(root, f"n{n}", world_size=n, phases={**DEFAULT_PHASES, "sync_exposed": 2 * MS * n})
    make_run(root, "other", world_size=1, experiment="other", source="simulated")
    return root


def test_json_is_the_documented_format(store_path, capsys):
    assert main(["analyze", str(store_path), "--json", "--experiment", "exp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "perfscope-analyze" and out["format_version"] == JSON_FORMAT_VERSION
    assert set(out) == {
        "format",
        "format_version",
        "perfscope_version",
        "store",
        "selection",
        "runs",
        "scaling",
        "mfu",
        "batch_sweep",
        "time_to_metric",
        "what_if",
        "findings",
        "evidence",
        "definitions",
    }
    assert out["selection"]["experiments"] == ["exp"]
    assert [r["run_id"] for r in out["runs"]] == ["n1", "n2", "n4", "n8"]
    with open_store(store_path) as store:
        expected = {r["run_id"]: r["efficiency"] for r in run_analysis("scaling", store).to_pylist()}
    assert {r["run_id"]: r["efficiency"] for r in out["scaling"]} == {
        k: expected[k] for k in ("n1", "n2", "n4", "n8")
    }
    top = out["findings"][0]
    assert top["rule"] == "communication-bound"
    assert set(top) == {
        "id",
        "rule",
        "severity",
        "category",
        "title",
        "text",
        "evidence",
        "recommendation",
        "confidence",
        "confidence_label",
        "explained_loss",
        "numbers",
        "group_id",
        "groups",
        "symptoms",
        "also_in",
    }
    assert set(out["definitions"]) >= {"speedup", "busbw", "pop"}


def test_text_report_has_tables_and_ranked_findings(store_path, capsys, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["analyze", str(store_path)]) == 0
    out = capsys.readouterr().out
    assert "exp · c1 · nccl · mlp · weak:b32  (weak scaling, baseline N0=1)" in out
    assert "1. [ALARM] Communication-bound at N=8" in out
    assert "\033[" not in out
    assert "simulated" in out  # the simulated run is marked in the runs table


def test_colour_when_forced(store_path, capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert main(["analyze", str(store_path), "--run", "n8", "--run", "n1"]) == 0
    assert "\033[1;31m[ALARM]" in capsys.readouterr().out


def test_empty_selection_and_missing_store_are_clear_errors(store_path, tmp_path, capsys):
    assert main(["analyze", str(store_path), "--experiment", "nope"]) == 2
    assert "no runs" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
