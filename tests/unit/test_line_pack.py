"""The lines' own Redis protocol packer makes the bytes redis-py's would."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from redis.connection import Connection

from celery_crawl.worker.lines import pack

_ARG = st.one_of(st.text(), st.binary(), st.integers(), st.floats(allow_nan=True),
                 st.sampled_from(["", "é€😀", "claim:task:x", 0, -1, 10**30, 1.5e-300]))


def _redis_py(command: tuple[Any, ...]) -> bytes:
    return b"".join(bytes(chunk) for chunk in Connection().pack_command(*command))


@given(st.lists(_ARG, min_size=0, max_size=30))
def test_a_script_call_packs_as_redis_py_packs_it(args: list[Any]) -> None:
    command = ("EVALSHA", "0" * 40, len(args), *args)
    assert pack(command) == _redis_py(command)


def test_a_large_value_packs_whole() -> None:
    command = ("EVALSHA", "a" * 40, 1, "k", "x" * 200_000, b"\x00" * 70_000)
    assert pack(command) == _redis_py(command)


@pytest.mark.parametrize("bad", [True, None, object(), ["a"]])
def test_an_argument_redis_py_refuses_is_refused(bad: Any) -> None:
    with pytest.raises(redis.DataError):
        _redis_py(("EVALSHA", "a", 0, bad))
    with pytest.raises(redis.DataError):
        pack(("EVALSHA", "a", 0, bad))
