"""fsm-kernel on engines users already run: each integration is an optional extra, imported by
its own module (`fsm_kernel.integrations.dbos` needs `pip install 'fsm-kernel[dbos]'`)."""
