"""The etcd store beside other protobuf users, and without its extra.

Each case is a fresh interpreter, because protobuf's implementation and what is in its default
descriptor pool are per process and decided by whoever imports protobuf first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import EtcdServer, RedisServer

ROOT = Path(__file__).resolve().parents[2]

#: What the store does in each case: leases, a batch of claims, fenced and TTL'd records,
#: renewals, and python-etcd3's client on the same process.
_EXERCISE = """
from celery_crawl.leases import open_store
from celery_crawl.leases.etcd import python_etcd3
s = open_store(URL, namespace=NS)
lease = s.acquire('w', 5, 'h')
assert lease is not None
tokens = s.claim_many(lease, [(f'task:{i}', {'i': i}) for i in range(300)])
assert all(tokens), tokens
s.put('done/1', {'state': 'SUCCESS'}, ttl_s=30)
s.put('fenced', {'v': 1}, lease=lease)
assert s.get('done/1') == {'state': 'SUCCESS'} and s.get('fenced') == {'v': 1}
trips = s.round_trips
assert s.renew(lease).token == lease.token and s.round_trips == trips + 1
assert s.unclaim(lease, 'task:0') and s.claimant('task:1').alive
client = python_etcd3().client('127.0.0.1', PORT, timeout=5)
value, meta = client.get(NS + ':rec:done/1')
assert b'SUCCESS' in value, value
client.close()
s.release(lease)
s.close()
from google.protobuf.internal import api_implementation
print('OK', api_implementation.Type())
"""

#: Another library's generated code first: protobuf's own well-known types, and a different
#: ``kv.proto``/``rpc.proto`` (another etcd client's, say) in the default pool, defining
#: ``mvccpb.KeyValue`` and ``etcdserverpb.RangeRequest`` differently from etcd's.
_FOREIGN_UPB = """
from google.protobuf import descriptor_pb2, descriptor_pool, timestamp_pb2
from google.protobuf.internal import api_implementation
assert api_implementation.Type() == 'upb', api_implementation.Type()
assert timestamp_pb2.Timestamp(seconds=1).seconds == 1
for name, package, message in (('kv.proto', 'mvccpb', 'KeyValue'),
                               ('rpc.proto', 'etcdserverpb', 'RangeRequest')):
    f = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax='proto3')
    m = f.message_type.add(name=message)
    m.field.add(name='other', number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    descriptor_pool.Default().AddSerializedFile(f.SerializeToString())
"""

#: Pure-Python protobuf chosen by someone else, and python-etcd3's own stubs already loaded.
_FOREIGN_PYTHON = """
from google.protobuf.internal import api_implementation
assert api_implementation.Type() == 'python', api_implementation.Type()
import etcd3.etcdrpc
assert etcd3.etcdrpc.RangeRequest(key=b'x').key == b'x'
"""


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**base, **(env or {})})


@pytest.mark.parametrize(("impl", "first"), [("upb", _FOREIGN_UPB), ("python", _FOREIGN_PYTHON)])
def test_etcd_store_works_whichever_protobuf_another_library_loaded_first(
        etcd_server: EtcdServer, impl: str, first: str) -> None:
    env = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"} if impl == "python" else {}
    setup = (f"URL = {etcd_server.url!r}; PORT = {etcd_server.client_port}; "
             f"NS = 'pb-{impl}'\n")
    out = _run(first + setup + _EXERCISE, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["OK", impl], out.stdout
    assert "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION" not in out.stderr


#: Makes the etcd extra's packages absent, as on a Redis-only install.
_NO_EXTRA = """
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('grpc', 'etcd3') or name.startswith('google.protobuf'):
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, _Absent())
"""


def test_etcd_url_without_the_extra_is_a_config_error_naming_it() -> None:
    code = _NO_EXTRA + (
        "from celery_crawl.errors import ConfigError\n"
        "from celery_crawl.leases import open_store\n"
        "try:\n"
        "    open_store('etcd://127.0.0.1:2379', namespace='x')\n"
        "except ConfigError as exc:\n"
        "    print('CONFIG', exc)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("CONFIG"), out.stdout
    assert "celery-crawl[etcd]" in out.stdout and "crawl_lease_url" in out.stdout, out.stdout


def test_redis_only_install_needs_no_grpc_or_protobuf(redis_server: RedisServer) -> None:
    code = _NO_EXTRA + (
        "import celery_crawl, celery_crawl.beat, celery_crawl.worker, celery_crawl.cli\n"
        "from celery_crawl.leases import open_store\n"
        f"s = open_store({redis_server.url!r}, namespace='no-grpc')\n"
        "lease = s.acquire('w', 5, 'h')\n"
        "assert lease is not None and s.claim(lease, 'task:1', {}) is not None\n"
        "s.put('done/1', {'ok': 1}, ttl_s=30)\n"
        "assert s.get('done/1') == {'ok': 1}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'etcd3')\n"
        "             or m.startswith('google.protobuf'))\n"
        "print('LOADED', bad)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "LOADED []", out.stdout
