"""DueHeap against a plain dict model."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_crawl.schedules import DueHeap

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_basic_order_replace_and_remove():
    heap = DueHeap()
    heap.push("a", T0 + timedelta(seconds=30))
    heap.push("b", T0 + timedelta(seconds=10))
    heap.push("c", T0 + timedelta(seconds=20))
    heap.push("b", T0 + timedelta(seconds=40))  # rescheduled: the old item is stale
    heap.remove("c")
    assert len(heap) == 2 and "c" not in heap
    assert heap.peek() == ("a", T0 + timedelta(seconds=30))
    assert heap.pop_due(T0 + timedelta(seconds=35)) == [("a", T0 + timedelta(seconds=30))]
    assert heap.pop_due(T0 + timedelta(seconds=35)) == []
    assert heap.when("b") == T0 + timedelta(seconds=40)
    assert heap.pop_due(T0 + timedelta(hours=1)) == [("b", T0 + timedelta(seconds=40))]
    assert heap.peek() is None and len(heap) == 0
    heap.remove("never-there")


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from("abcdefgh"), st.integers(0, 100)),
        st.tuples(st.just("remove"), st.sampled_from("abcdefgh"), st.just(0)),
        st.tuples(st.just("pop"), st.just(""), st.integers(0, 100)),
    ),
    max_size=200,
)


@settings(max_examples=200)
@given(ops=ops)
def test_matches_a_dict_model(ops):
    heap, model = DueHeap(), {}
    for op, name, t in ops:
        when = T0 + timedelta(seconds=t)
        if op == "push":
            heap.push(name, when)
            model[name] = when
        elif op == "remove":
            heap.remove(name)
            model.pop(name, None)
        else:
            got = heap.pop_due(when)
            expected = sorted((w, n) for n, w in model.items() if w <= when)
            assert [w for _, w in got] == [w for w, _ in expected]
            assert {n for n, _ in got} == {n for _, n in expected}
            for n, _ in got:
                del model[n]
        assert len(heap) == len(model)
        top = heap.peek()
        assert (top[1] if top else None) == (min(model.values()) if model else None)
