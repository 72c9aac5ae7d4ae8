"""fsm-kernel: an agent runtime whose loop is an explicit finite-state machine written in YAML."""

__version__ = "0.1.0"
