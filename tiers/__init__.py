"""Storage tiers. Each implements :class:`tiers.base.Tier`; the store composes them by name."""
