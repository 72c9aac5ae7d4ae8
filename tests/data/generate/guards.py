"""Python guards for the test generator's tests: one that says which replies decide it, and one
that never holds."""

from fsm_kernel.testing import witnesses
from fsm_kernel.workflow.context import RunContext


@witnesses("LGTM")
def reviewer_approved(ctx: RunContext) -> bool:
    """The reviewer's reply starts with LGTM."""
    c = ctx.last_completion
    return c is not None and c.message.content.strip().startswith("LGTM")


def never(ctx: RunContext) -> bool:
    """Holds for no run."""
    return False
