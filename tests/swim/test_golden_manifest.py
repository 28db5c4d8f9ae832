"""Sanity checks for the golden Serf packet corpus in tests/golden/serf.

The corpus is produced by scripts/capture_serf_golden.py from real serf agents; these
tests only check that the manifest is well-formed and matches the files next to it.
Decoding the packets is the codec tests' job.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "serf"
MANIFEST = GOLDEN / "manifest.json"

REQUIRED_ENTRY_KEYS = {
    "file": str,
    "transport": str,
    "scenario": str,
    "src": str,
    "dst": str,
    "first_byte": int,
    "length": int,
    "sha256": str,
    "summary": str,
}


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(MANIFEST.read_text())
    return data


def test_top_level_metadata(manifest: dict[str, Any]) -> None:
    assert manifest["serf_version"]
    assert manifest["captured_at"]
    names = {n["name"] for n in manifest["nodes"]}
    assert names == {"a", "b", "c"}
    for node in manifest["nodes"]:
        assert node["address"] == "127.0.0.1"
        assert isinstance(node["gossip_port"], int)
        assert node["rpc_addr"].startswith("127.0.0.1:")
        assert node["tags"]
    for key in manifest["keys"].values():
        assert len(base64.b64decode(key["base64"])) == key["bytes"]
        assert key["bytes"] in (16, 24, 32)
    assert set(manifest["scenarios"]) == {"plain", "encrypted"}
    for scenario in manifest["scenarios"].values():
        assert scenario["commands"]
    assert (GOLDEN / "README.md").is_file()


def test_entries_well_formed(manifest: dict[str, Any]) -> None:
    entries = manifest["entries"]
    assert entries
    seen: set[str] = set()
    node_names = {n["name"] for n in manifest["nodes"]}
    for e in entries:
        for key, typ in REQUIRED_ENTRY_KEYS.items():
            assert isinstance(e.get(key), typ), (e.get("file"), key)
        assert e["file"] not in seen, e["file"]
        seen.add(e["file"])
        assert e["transport"] in ("udp", "tcp")
        assert e["scenario"] in ("plain", "encrypted")
        assert e["file"].startswith(e["scenario"] + "/")
        assert e["src"] in node_names and e["dst"] in node_names, e["file"]
        # src == dst happens: an agent answers its own serf query (queryResponse to self)
        assert 0 <= e["first_byte"] <= 255
        if e["transport"] == "tcp":
            assert e["direction"] in ("initiator", "responder")
            assert isinstance(e["conn"], int)
        if e["scenario"] == "encrypted":
            assert e["key"] in manifest["keys"], e["file"]
            assert e["summary"].startswith("encrypted v")
        else:
            assert "key" not in e
        assert "undecodable" not in e["summary"], e["file"]


def test_files_exist_and_match(manifest: dict[str, Any]) -> None:
    total = 0
    for e in manifest["entries"]:
        path = GOLDEN / e["file"]
        assert path.is_file(), e["file"]
        data = path.read_bytes()
        assert data, e["file"]
        assert len(data) == e["length"], e["file"]
        assert data[0] == e["first_byte"], e["file"]
        assert hashlib.sha256(data).hexdigest() == e["sha256"], e["file"]
        total += len(data)
    assert total < 2 * 1024 * 1024


def test_no_stray_files(manifest: dict[str, Any]) -> None:
    listed = {e["file"] for e in manifest["entries"]}
    on_disk = {p.relative_to(GOLDEN).as_posix() for p in GOLDEN.glob("*/*.bin")}
    assert on_disk == listed


def test_coverage_complete(manifest: dict[str, Any]) -> None:
    listed = {e["file"] for e in manifest["entries"]}
    for kind, files in manifest["coverage"].items():
        assert files, f"no golden example of {kind}"
        assert set(files) <= listed, kind
    assert manifest["missing"] == []
