"""The benchmark scripts run end to end at a tiny size and report every figure (so they cannot drift)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

#: Every contract figure benchmark.py must report for each state.
STATE_FIGURES = (
    "dcp.save (thread_count=1) / plain write",
    "dcp.save (thread_count=2) / plain write",
    "best dcp.save / plain write",
    "best dcp.save / ms.save_checkpoint+fsync",
    "protection: xxh3 checksums (1 thread) / best dcp.save",
    "protection: fsync, save / save without fsync (1 thread)",
    "async blocking (first call) / memcpy",
    "async blocking (steady) / memcpy",
    "async result() after done() / memcpy",
    "async blocking (first call after prepare_async_save) / memcpy",
    "staging copy floor / memcpy",
    "async blocking (steady) / staging copy floor",
    "async blocking (steady), caller's CPU / memcpy",
    "async, auto blocking (first call) / memcpy",
    "async, auto blocking (steady) / memcpy",
    "async first write to every page after the call (first call) / memcpy",
    "async, fork first write to every page after the call (first call) / memcpy",
    "async, fork blocking (first call) / memcpy",
    "async, fork blocking (steady) / memcpy",
    "cold load / cold read, verify on",
    "cold load / cold read, verify off",
    "cold read, 2 streams / cold sequential read",
    "cold load, verify on / cold read, 2 streams",
    "cold load, verify on: before the verify pass / cold sequential read",
    "cold load, verify on: verify pass / cold sequential read",
    "cold load, verify on: read pass / cold sequential read",
    "cold load, verify on: after the read pass / cold sequential read",
    "warm load / memcpy, verify on",
    "warm load / memcpy, verify off",
    "protection: verify, warm load on / off",
    "protection: verify, cold load on / off",
    "protection: verify, warm load on / off, CPU time (paired)",
    "protection: checksums, save on / off (thread_count=2, paired)",
    "protection: save lease take + release / best dcp.save",
    "protection: header check / warm load, verify off (2 threads)",
    "commit (writer.finish) / dcp.save (thread_count=2)",
    "best dcp.save / plain write with early writeback",
    "warm read floor (2 threads) / memcpy",
    "warm verified read floor (2 threads) / memcpy",
    "warm load, verify on / its floor",
    "warm load, verify off / its floor",
    "hyper_parallel.load_checkpoint(path, net) cold / cold read",
    "hyper_parallel.load_checkpoint(path, net) warm / memcpy",
    "hyper_parallel.load_checkpoint(path) cold / cold read",
    "hyper_parallel.load_checkpoint(path) warm / memcpy",
    "hyper_parallel.load_checkpoint(path) warm / host memcpy into new memory",
    "hyper_parallel.load_checkpoint(path) cold / ms.load_checkpoint cold",
    "hyper_parallel.load_checkpoint(path) warm / ms.load_checkpoint warm",
    "hyper_parallel.load_checkpoint(path, net) cold / ms.load+load_param_into_net cold",
)
RESHARD_FIGURES = (
    "reshard reader bytes / needed, verify on, worst rank",
    "reshard /proc read / needed, verify on, worst rank",
    "reshard /proc read / needed, verify off, worst rank",
    "reshard /proc read / needed, verify on, 2x max_inflight_bytes, worst rank",
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return env


@pytest.mark.timeout(600)
def test_benchmark_reports_every_figure_for_both_states(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "benchmark.py"), "--size-gb", "0.004", "--runs", "1", "--warm-runs", "2",
         "--pretouch-gb", "0",
         "--out", str(tmp_path / "work"), "--json", str(out), "--msrun-timeout", "400"],
        env=_env(), capture_output=True, text=True, timeout=560, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["states"]) == {"many", "large"}
    # hp-ckpt import of 4 MindSpore rank files: each byte of them read once (the replicas to compare them).
    assert result["ms_import"]["median"]["import"]["read_bytes"] < 1.2 * result["ms_import"]["rank_file_bytes"]
    ms_import = result["ms_import"]
    assert ms_import["median"]["transform_checkpoints"]["read_bytes"] >= ms_import["rank_file_bytes"]
    assert result["states"]["many"]["tensors"] >= 200 and result["states"]["large"]["tensors"] == 16
    for kind, state in result["states"].items():
        figures = {row["figure"]: row for row in state["ratios"]}
        for name in STATE_FIGURES:
            assert name in figures, (kind, name)
            assert math.isfinite(figures[name]["value"]) and figures[name]["value"] > 0, (kind, name)
        assert figures["async blocking (first call) / memcpy"]["target"] == "<= 1"  # the first call is rated
        for verify in ("on", "off"):  # a cold load's device reads per run, against the files' size
            runs = state["notes"][f"device bytes / file bytes, dcp.load cold, verify {verify} (2 threads)"].split()
            assert runs and all(float(r) > 0 for r in runs), (kind, verify, runs)
            # a warm load's too (above 0.00: the run was not warm), one per warm run
            warm = state["notes"][f"device bytes / file bytes, dcp.load warm, verify {verify} (2 threads)"].split()
            assert len(warm) == 2 and all(float(r) >= 0 for r in warm), (kind, verify, warm)
        assert state["notes"]["async commit thread"] != "MainThread"  # the commit is timed and runs off the caller
        assert f"ratios, state '{kind}'" in proc.stdout
    many = {row["figure"]: row["value"] for row in result["states"]["many"]["ratios"]}
    assert result["states"]["many"]["small_tensors_loaded_alone"] >= 200  # the per-tensor cost of a load
    for verify in ("on", "off"):
        assert 0 < many[f"warm load, small Parameters alone, verify {verify}: us per tensor"] < 1e5
        assert 0 < many[f"warm load, small Parameters alone, verify {verify}: CPU us per tensor"] < 1e5
    assert math.isfinite(many["warm load, small Parameters alone: verify's own CPU us per tensor (on - off)"])
    assert 0 < many["read_metadata, small Parameters alone: CPU us per tensor"] < 1e4  # the decode's share
    reshard = {row["figure"]: row for row in result["reshard_ratios"]}
    for name in RESHARD_FIGURES:
        assert math.isfinite(reshard[name]["value"]) and reshard[name]["value"] >= 0.99, name
    assert "w_bf16_1024" in result["reshard"]["description"]  # narrow rows are measured
    result_ms = reshard["async result() ms after done(), 2 ranks, small state, slowest rank"]["value"]
    assert math.isfinite(result_ms) and result_ms > 0  # what result() of a multi-rank async save still blocks


def _run_small(script: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run a planning-side script with 4 and 32 (or 16) ranks of 20 tensors, JSON to ``out``."""
    ranks = ["4", "16"] if script == "bench_planning.py" else ["4", "32"]
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--ranks", *ranks, "--tensors", "20",
                           "--json", str(out), *extra], env=_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_bench_planning_reports_time_and_bytes_per_rank(tmp_path):
    proc = _run_small("bench_planning.py", tmp_path / "plan.json", "--general-up-to", "16")
    rows = json.loads((tmp_path / "plan.json").read_text())
    assert [row["ranks"] for row in rows] == [4, 16]
    for row in rows:
        assert row["items"] == row["ranks"] * 20 and row["seconds"] > 0 and row["unpickle_seconds"] > 0
        assert row["merge_seconds"] > 0 and row["general_seconds"] > 0 and row["reuse_seconds"] > 0
        assert row["rank_send_seconds"] > 0
        assert row["reuse_bytes_received_per_rank"] < row["reuse_bytes_sent_per_rank"] * row["ranks"]
        assert row["tensors"] == 20 and row["written_items"] == 10 + 10 * row["ranks"]
        assert row["same_result_as_general"] is True  # the layout merge decides what the per-item merge decides
        assert 0 < row["bytes_received_per_noncoordinator_rank"] < (
            row["bytes_received_per_noncoordinator_rank_allgather"])
    # With an all-gather a rank receives every rank's plan: it grows with the world, the scatter does not.
    assert rows[1]["bytes_received_per_noncoordinator_rank_allgather"] > 3 * rows[0][
        "bytes_received_per_noncoordinator_rank_allgather"]
    assert rows[1]["bytes_received_per_noncoordinator_rank"] <= rows[0]["bytes_received_per_noncoordinator_rank"] + 8
    # The commit answers every rank with a receipt: the same bytes whatever the world; the metadata grew.
    commit = [row["commit_bytes_received_per_noncoordinator_rank"] for row in rows]
    before = [row["commit_bytes_received_per_noncoordinator_rank_before_at_least"] for row in rows]
    assert commit[0] == commit[1] < 300 and before[0] < before[1]
    assert "time per item" in proc.stdout and "same writers and metadata as the per-item merge: True" in proc.stdout


def test_bench_metadata_reports_size_read_time_and_rank_planning(tmp_path):
    proc = _run_small("bench_metadata.py", tmp_path / "meta.json", "--indexed-ranks", "64", "--indexed-tensors", "20",
                      "--commit-ranks", "8", "--commit-tensors", "5")
    result = json.loads((tmp_path / "meta.json").read_text())
    assert [row["chunks"] for row in result["measured"]] == [80, 640]
    for row in result["measured"]:
        assert row["metadata_bytes"] > 100 * row["chunks"] and row["read_metadata_s"] > 0
        assert row["rank_load_planning_s"] > 0
        assert row["read_peak_rss_bytes"] >= row["read_retained_rss_bytes"]
    # The extrapolation comes from a least-squares fit over the measured sizes and says so.
    fit = result["fits"]["metadata_bytes"]
    assert 100 < fit["slope"] < 1000 and fit["max_relative_deviation"] < 0.2
    extrapolated = result["extrapolated"]
    assert extrapolated["chunks"] == 10240 * 10000 and extrapolated["label"].startswith("EXTRAPOLATED")
    assert extrapolated["metadata_bytes"] == fit["intercept"] + fit["slope"] * 10240 * 10000
    assert "EXTRAPOLATED in-line form, for comparison (linear fit) to 10240 ranks" in proc.stdout
    assert "linear fit read_metadata_s" in proc.stdout
    # The indexed form is measured, not extrapolated: O(tensors + ranks) metadata, a rank reads one index.
    indexed = result["indexed"]
    assert indexed["label"] == "MEASURED" and indexed["chunks"] == 64 * 20
    assert indexed["metadata_bytes"] < 100 * 20 + 120 * 64 + 2000 < 100 * indexed["chunks"]
    assert indexed["own_shard_planning_s"] > 0 and indexed["reshard_lookup_s"] > 0
    assert "MEASURED indexed form (format 2.1) at 64 ranks x 20 tensors" in proc.stdout
    commit = result["commit"]
    assert commit["chunks"] == 40 and commit["indexed_index_bytes"] > 100 * 40 > commit["indexed_metadata_bytes"] / 4
    assert commit["inline_metadata_bytes"] > 100 * 40 and commit["gathered_bytes_per_chunk"] > 50


def test_bench_gather_reports_bytes_received_and_commit_memory(tmp_path):
    out = tmp_path / "gather.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_gather.py"), "--ranks", "8", "--tensors", "5", "40",
                           "--large-ranks", "64", "--large-tensors", "30", "--json", str(out)],
                          env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    small, large = result["rows"]
    # Write results grow with the chunks a rank holds; a rank's summary does not.
    assert large["built"]["received_bytes_per_rank"] > 6 * small["built"]["received_bytes_per_rank"]
    assert large["record_only"]["received_bytes_per_rank"] == small["record_only"]["received_bytes_per_rank"]
    assert large["record_only"]["received_bytes_per_rank"] < small["built"]["received_bytes_per_rank"]
    assert result["large"]["chunks"] == 64 * 30 and result["large"]["metadata_bytes"] > 0
    assert "MEASURED record-only commit at 64 ranks x 30 tensors" in proc.stdout
