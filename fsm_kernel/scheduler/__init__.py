"""The persistent agent: cron ticks -> STATE.md -> planner -> dispatch queue -> kernel runs.

The kernel run itself is injected (`AgentRunner`); nothing here imports the kernel or the tools.
"""

from fsm_kernel.scheduler.config import (
    AgentSpec,
    SchedulerConfig,
    load_scheduler_config,
    parse_scheduler_config,
)
from fsm_kernel.scheduler.cron import CronSchedule, check_cron_expression
from fsm_kernel.scheduler.engine import CycleResult, Scheduler
from fsm_kernel.scheduler.executor import (
    AgentRunner,
    DispatchDetail,
    ExecutionStatus,
    RunOutcome,
    default_worker_id,
)
from fsm_kernel.scheduler.planner import Plan, PlannedDispatch, SkippedAgent, plan_dispatches
from fsm_kernel.scheduler.queue import (
    Dispatch,
    DispatchListener,
    DispatchQueue,
    DispatchStatus,
    QueueSignal,
    SqliteDispatchQueue,
    open_queue,
)
from fsm_kernel.scheduler.statefile import StateFile, state_tools
from fsm_kernel.scheduler.worker import Worker

__all__ = [
    "AgentRunner",
    "AgentSpec",
    "CronSchedule",
    "CycleResult",
    "Dispatch",
    "DispatchDetail",
    "DispatchListener",
    "DispatchQueue",
    "DispatchStatus",
    "ExecutionStatus",
    "Plan",
    "PlannedDispatch",
    "QueueSignal",
    "RunOutcome",
    "Scheduler",
    "SchedulerConfig",
    "SkippedAgent",
    "SqliteDispatchQueue",
    "StateFile",
    "Worker",
    "check_cron_expression",
    "default_worker_id",
    "load_scheduler_config",
    "open_queue",
    "parse_scheduler_config",
    "plan_dispatches",
    "state_tools",
]
