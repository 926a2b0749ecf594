"""The committed etcd stubs (celery_crawl/leases/_etcdpb/) are exactly what
scripts/gen_etcd_stubs.py generates from python-etcd3's descriptors with the installed
grpcio-tools: nobody edits them by hand, and a grpcio-tools upgrade that changes them shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "celery_crawl" / "leases" / "_etcdpb"


def test_committed_stubs_match_the_generator(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_etcd_stubs.py"),
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    generated = {p.name: p.read_text() for p in tmp_path.glob("*.py")}
    committed = {p.name: p.read_text() for p in COMMITTED.glob("*.py")}
    assert sorted(generated) == sorted(committed), "files added or missing"
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, (f"{stale} differ from scripts/gen_etcd_stubs.py's output: run it and "
                       f"commit the result")
    # The one change made to protoc's output: descriptors in the package's private pool.
    for name in ("kv_pb2.py", "auth_pb2.py", "rpc_pb2.py"):
        assert "_pool.POOL.AddSerializedFile(" in committed[name]
        assert "_descriptor_pool.Default()" not in committed[name]
