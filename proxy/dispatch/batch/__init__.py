"""Batch tiers: the OpenAI Batch API backend (:mod:`.api`), lines waiting on it
(:mod:`.pool`), the service tiers a model's backends offer (:mod:`.tier_profiles`),
``service_tier`` on the wire (:mod:`.flex`)."""
