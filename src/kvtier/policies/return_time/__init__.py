"""``return-time``: prefix-closed eviction by learned holding times, in its parts.

* :mod:`~kvtier.policies.return_time.wheel`: the storage, a prefix-closed timing wheel
  over row slots (every hold 0: LRU's order);
* :mod:`~kvtier.policies.return_time.classes`: the hold classifier (class of a
  reference, hold of a class, the table of request ends);
* :mod:`~kvtier.policies.return_time.model`: the learning half (sampled return
  times, survival curves, the holds that maximise predicted hits);
* :mod:`~kvtier.policies.return_time.guard`: the guard against losing to LRU;
* :mod:`~kvtier.policies.return_time.policy`: :class:`ReturnTimePolicy`, which joins them.
"""

from kvtier.policies.return_time.classes import CLASSES, NEW_BUCKETS, class_id
from kvtier.policies.return_time.policy import ReturnTimePolicy
from kvtier.policies.return_time.wheel import RING, ExpiryWheel

__all__ = ["CLASSES", "NEW_BUCKETS", "RING", "ExpiryWheel", "ReturnTimePolicy", "class_id"]
