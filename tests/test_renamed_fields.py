"""Files written under a field's former name still read (config.RENAMED_FIELDS): a rung declared with
``checkpoint=`` (now ``activation_checkpointing``), and the committed results/ JSONs, whose
``estimate.assumptions`` say ``checkpoint`` (nothing in the package reads that key back)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fabric_memory_recipes.config import RENAMED_FIELDS
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.planning.check import check_results

REPO = Path(__file__).resolve().parents[1]
OLD_RESULT = REPO / "results/published/h100/estimate/eager/10_activation_checkpointing.json"


def test_an_old_results_json_reads_its_activation_checkpointing(tmp_path):
    old = json.loads(OLD_RESULT.read_text())
    assumptions = old["estimate"]["assumptions"]
    assert "checkpoint" in assumptions and "activation_checkpointing" not in assumptions, "an old-style file"
    shutil.copy(OLD_RESULT, tmp_path / OLD_RESULT.name)
    (row,) = check_results([str(tmp_path)])
    assert row["predicted_gb"] == old["estimate"]["peak_allocated_gb"]


def test_a_rung_declared_under_the_old_name_reads(tmp_path):
    assert RENAMED_FIELDS["checkpoint"] == "activation_checkpointing"
    (tmp_path / "99_old.py").write_text(
        '"""An old rung."""\nRUNG = RunConfig(recipe="99_old", checkpoint=("Block",))\n'
    )
    rung, doc = declared_rung("99", folder=tmp_path)
    assert rung.activation_checkpointing == ("Block",) and doc == "An old rung."
