"""Test support for code built on kvtier: the conformance suite every secondary tier must pass.

Needs pytest (``pip install 'kvtier[test]'``); nothing in kvtier imports this
package. The names are those of :mod:`kvtier.testing.conformance`::

    from kvtier.testing import TierConformance, TierHarness
"""

from kvtier.testing.conformance import *  # noqa: F403
from kvtier.testing.conformance import __all__ as __all__
