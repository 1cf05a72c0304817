"""The hold classifier of return-time: class ids from one function, the extension draw, request ends."""

from __future__ import annotations

import itertools

from policy_helpers import key

from kvtier.policies.fingerprints import fingerprint
from kvtier.policies.return_time.classes import (
    BASE_OF_NEW,
    CLASSES,
    LAST,
    NEW_BUCKETS,
    TOUCH_LEVELS,
    HoldClassifier,
    OpenRequest,
    class_id,
    new_bucket,
    touches_of,
)
from kvtier.policies.return_time.model import HoldingPlan


def test_class_ids_number_every_feature_combination_once() -> None:
    ids = [
        class_id(b, last, t) for b, last, t in itertools.product(range(NEW_BUCKETS), (False, True), range(TOUCH_LEVELS))
    ]
    assert sorted(ids) == list(range(CLASSES))
    for b, last, t in itertools.product(range(NEW_BUCKETS), (False, True), range(TOUCH_LEVELS)):
        cls = class_id(b, last, t)
        assert cls == class_id(b, False, 0) + class_id(0, last, t), "the hot paths add the two halves"
        assert touches_of(cls) == t
    assert class_id(0, True, 0) == LAST


def test_new_blocks_fall_in_buckets_of_at_most_1_3_7_and_more() -> None:
    assert [new_bucket(n) for n in range(12)] == [0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert [class_id(new_bucket(n), False, 0) for n in range(len(BASE_OF_NEW))] == BASE_OF_NEW


def test_the_extension_is_drawn_for_its_share_of_requests() -> None:
    classes = HoldClassifier(64)
    plan = HoldingPlan([5] * CLASSES, partial=2, extended=1000, fraction=0.25)
    classes.use(plan, max_hold=600)
    assert classes.extended == 600, "holds are capped by what the wheel orders"
    draws = [classes.draw_extension() for _ in range(400)]
    assert sum(draws) == 100
    assert classes.extension_hold(True) == 600 and classes.extension_hold(False) == 5
    classes.use(None, 600)
    assert classes.hold == [0] * CLASSES and classes.extension_hold(True) == 0


def test_new_blocks_count_from_a_recorded_request_end_or_a_block_referenced_before() -> None:
    classes = HoldClassifier(64)
    keys = [key(i) for i in range(1, 7)]
    touches = bytearray(8)
    assert classes.new_blocks(keys, (), touches) == 6, "nothing recorded: all new"
    classes.history.add(fingerprint(keys[2]))
    assert classes.new_blocks(keys, (), touches) == 3, "after the recorded end"
    touches[4] = 1  # the block in slot 4 (key 5) was referenced before
    assert classes.new_blocks(keys, list(range(6)), touches) == 1


def test_a_request_end_is_its_last_full_block() -> None:
    assert HoldClassifier.request_end([key(1), key(2), key(3)], None) == fingerprint(key(2))
    assert HoldClassifier.request_end([key(3)], key(9)) == fingerprint(key(9)), "one block: the one it extends"
    assert HoldClassifier.request_end([key(3)], None) == fingerprint(key(3))


def test_publishing_moves_a_request_end_in_place() -> None:
    classes = HoldClassifier(64)
    first, last = fingerprint(key(1)), fingerprint(key(5))
    classes.history.add(first)
    record = OpenRequest(
        key(6), new=5, stored=5, end=last, published=first, then=0, opened=0, held=0, drawn=False, diff=0
    )
    classes.publish(record)
    assert last in classes.history and first not in classes.history and len(classes.history) == 1
