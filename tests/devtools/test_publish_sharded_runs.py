"""scripts/gpu/publish_sharded_runs.py: the GPU script's tar published (folders per GPU count, the rows in the
sharded rungs' pages, the overhead table rewritten) and the two-node loss comparison; bad input exits 2."""

from __future__ import annotations

import importlib.util
import json
import tarfile

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location(
    "publish_sharded_runs", REPO / "scripts" / "gpu" / "publish_sharded_runs.py"
)
publish = importlib.util.module_from_spec(spec)
spec.loader.exec_module(publish)


def _row(rung, recipe, speed, reserved):
    side = {"status": "ok", "images_per_s": speed, "peak_reserved_gb": reserved}
    ref = {"status": "ok", "images_per_s": 100.0, "peak_reserved_gb": 4.0, "script": "11_delay-allocation.py"}
    ratios = {"speed_fast_vs_reference": speed / 100.0, "reserved_fast_vs_reference": reserved / 4.0}
    return {
        "rung": rung,
        "recipe": recipe,
        "reference": ref,
        "fast": side,
        "eager": None,
        "like_for_like": True,
        "ratios": ratios,
        "call": {"gpu_name": "NVIDIA H100 80GB HBM3", "steps": 20},
    }


def _loss_run(curve, **prov):
    return {
        "loss": {"curve": curve},
        "provenance": {"world_size": 4, **prov},
        "timing": {"images_per_s": 9.0},
    }


def test_the_tar_is_published_per_gpu_count_and_the_rows_reach_the_pages(tmp_path):
    root = tmp_path / "out" / "sharded"
    for n, speed in (("4", 400.0), ("2", 300.0)):
        (root / f"x{n}" / "compare").mkdir(parents=True)
        rows = [_row("08-fsdp2", "08_fsdp2", speed, 3.9)]
        (root / f"x{n}" / "compare" / "comparison.json").write_text(json.dumps(rows))
    (root / "progress.log").write_text("[1 s] start\n")
    tar = tmp_path / "sharded.tgz"
    with tarfile.open(tar, "w:gz") as archive:
        archive.add(root, arcname="sharded")
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "08_fsdp2.md"
    page.write_text(
        "".join(
            f"<!-- results:sharded-{n}gpu:start -->\nold\n<!-- results:sharded-{n}gpu:end -->\n"
            for n in (4, 2)
        )
    )
    dest = tmp_path / "results" / "published"
    lines = publish.publish(tar, dest, docs, tmp_path / "table.json")
    assert (dest / "h100x4" / "compare" / "comparison.json").is_file()
    assert (dest / "h100x2" / "compare" / "comparison.json").is_file()
    assert (dest / "h100x4" / "sharded" / "progress.log").is_file()
    text = page.read_text()
    assert "old" not in text and text.count("| the article's script | 4.00 | 100.0 |") == 2
    assert (
        "| fast (default on CUDA) | 3.90 | 400.0 |" in text
        and "| fast (default on CUDA) | 3.90 | 300.0 |" in text
    )
    assert "08_fsdp2 x4: 4.00x the article's img/s at 0.97x its peak reserved per GPU (target met)" in lines
    assert any(line.startswith("08_fsdp2 x2: 3.00x") and "target: >= 3.5x" in line for line in lines)
    assert "sharded" in json.loads((tmp_path / "table.json").read_text())


def test_two_nodes_are_compared_step_by_step_with_one_node(tmp_path):
    for name, curve, prov in (
        ("one-node", [[5, 2.30], [10, 2.10]], {}),
        ("two-nodes", [[5, 2.30], [10, 2.1000001]], {"num_nodes": 2}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "08_fsdp2.json").write_text(json.dumps(_loss_run(curve, **prov)))
    result = publish.equivalence(tmp_path)
    assert result["status"] == "equal" and result["steps_compared"] == [5, 10]
    assert result["max_relative_difference"] == pytest.approx(0.0000001 / 2.1, rel=1e-3)
    (tmp_path / "two-nodes" / "08_fsdp2.json").write_text(json.dumps(_loss_run([[5, 2.30], [10, 2.2]])))
    assert publish.equivalence(tmp_path)["status"] == "different"
    assert publish.equivalence(tmp_path / "nowhere")["status"] == "missing"


def test_a_missing_tar_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        publish.main([str(tmp_path / "none.tgz")])
    assert exit_.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
