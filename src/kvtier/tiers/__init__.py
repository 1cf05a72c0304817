"""Secondary tiers: the contract (``base``), the value format and the backends."""
