"""`python -m fsm_kernel` is the `fsm-kernel` command."""

from fsm_kernel.cli import entry

entry()
