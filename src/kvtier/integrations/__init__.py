"""Engine integrations. Each lives in its own subpackage, depends on the kvtier core only,
and imports its engine lazily: importing :mod:`kvtier` never imports an engine."""
