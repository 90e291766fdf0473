"""planner: a hardware-aware planner for on-device training (which layers, what precision, what batch)."""

__version__ = "0.1.0"
