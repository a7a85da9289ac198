"""The benchmarks run to the end, small, as a user runs them (`ptb bench NAME ... --json`):
what they measure is recorded in BENCHMARKS.md, never asserted here; these tests only keep
them from rotting (a bench read the agent's journal entries as they used to be and stopped
with a KeyError after its first failover)."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "bench", *args,
                           "--json", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def test_failover_bench_runs_several_failovers(tmp_path):
    got = _bench(tmp_path, "failover", "--runs", "3")
    assert got["rows"] and any("from bus event" in str(r) for r in got["rows"])


def test_scale_bench_with_its_fragmentation_stream(tmp_path):
    got = _bench(tmp_path, "scale", "--servers", "4", "8", "--failovers", "2", "--phases", "3",
                 "--stream", "100")
    assert len(got["rows"]) == 4 and len(got["fragmentation"]) == 2
    assert set(got["exponents"]) == {"dp-tp-pp", "all-to-all"}


def test_scale_bench_with_one_size_has_no_exponent(tmp_path):
    got = _bench(tmp_path, "scale", "--servers", "4", "--plans", "dp-tp-pp",
                 "--failovers", "2", "--phases", "3", "--stream", "0")
    assert got["exponents"] == {"dp-tp-pp": None}
    assert any("no growth exponent" in n for n in got["notes"])


def test_datacenter_bench_on_opus2048(tmp_path):
    got = _bench(tmp_path, "datacenter", "--phases", "3", "--failovers", "1")
    assert got["rows"]


def test_datacenter_bench_of_grants_during_a_heavy_admission(tmp_path):
    got = _bench(tmp_path, "datacenter", "--admission", "--admissions", "1")
    assert [r["case"].split(" (")[0] for r in got["rows"]] == [
        "tenant's phase grant", "the same, during the heavy admission", "heavy admission"]
    assert got["samples_ms"]["alone"] and got["samples_ms"]["during"]


def test_watch_bench_puts_back_both_changes(tmp_path):
    got = _bench(tmp_path, "watch", "--runs", "1")
    assert [r["change"] for r in got["rows"]] == ["apply_circuits []", "power cycle"]
    assert all(len(v) == 1 for v in got["samples_ms"].values())


def test_bridges_bench_reads_through_every_path(tmp_path):
    got = _bench(tmp_path, "bridges", "--readings", "20", "--rounds", "2")
    assert [r["path"] for r in got["rows"]] == [
        "bus", "facade", "ophyd", "bluesky", "leco", "bluesky, no device", "leco, no device",
        "metrics scrape", "bus, scraped at 10 Hz"]
    assert all(len(v) >= 18 for v in got["samples_us"].values())
