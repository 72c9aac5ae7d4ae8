"""Coverage of a workflow by the cases run against it (`fsm-kernel test --coverage`): the states
the runs were in, the declared edges they took, each guarded edge's conditions seen both true
and false, and the termination reasons reached.

Which conditions were evaluated comes from each `transition.taken` event: its `tried` list (the
edges tried, each check with its value) where the log has one; else from the order the kernel
tries edges in (docs/explanation/semantics.md): every guarded edge tried before the one taken
was false there, the one taken true.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.kernel import RunResult
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.testing._harness import DeclaredTransition, declared_transitions
from fsm_kernel.workflow.compound import edges_tried
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["CaseCoverage"]


@dataclass
class CaseCoverage:
    """What the runs of one workflow's cases covered."""

    spec: WorkflowSpec
    cases: int = 0
    states: set[str] = field(default_factory=set)
    edges: set[int] = field(default_factory=set)
    outcomes: dict[str, set[bool]] = field(default_factory=dict)
    """Per condition (an edge's guard label, or one check of it): the values seen."""
    reasons: set[str] = field(default_factory=set)

    @functools.cached_property
    def _declared(self) -> dict[int, DeclaredTransition]:
        """The declared transitions and catch edges by index (read once)."""
        return {d.index: d for d in declared_transitions(self.spec)}

    def add(self, result: RunResult) -> None:
        """Count one case's run."""
        self.cases += 1
        if result.termination_reason is not None:
            self.reasons.add(str(result.termination_reason))
        for e in result.events:
            if e.type is EventType.STATE_ENTERED and e.state:
                self.states.add(str(e.state))
            elif e.type is EventType.TRANSITION_TAKEN:
                self._taken(e)

    def _taken(self, e: Event) -> None:
        index, target = int(e.data["index"]), str(e.data["target"])
        self.edges.add(index)
        if self.spec.ends_run(target):  # a final state records no state.entered
            self.states.add(target)
        tried = e.data.get("tried")
        if isinstance(tried, list):
            for edge in tried:
                for check in edge.get("checks") or ():
                    label = f"{self._edge(int(edge['edge']), guard=False)}: {check['check']}"
                    self.outcomes.setdefault(label, set()).add(bool(check["value"]))
            return
        if e.data.get("catch") is not None or not e.state or e.state not in self.spec.states:
            return
        for i in edges_tried(self.spec, str(e.state)):
            if self.spec.transitions[i].is_guarded:
                self.outcomes.setdefault(self._edge(i), set()).add(i == index)
            if i == index:
                break

    def _edge(self, index: int, *, guard: bool = True) -> str:
        t = self._declared[index]
        return f"{t.source} → {t.target}" + (f" [{t.guard}]" if t.guard and guard else "")

    # -- the figures ------------------------------------------------------------------------

    @property
    def declared_edges(self) -> list[int]:
        return list(self._declared)

    @property
    def edge_percent(self) -> float:
        declared = self.declared_edges
        return 100.0 * len(self.edges & set(declared)) / len(declared) if declared else 100.0

    def conditions(self) -> dict[str, set[bool]]:
        """Every guarded edge (or, with `tried`, each of its checks) and the values seen."""
        out: dict[str, set[bool]] = {
            self._edge(i): set() for i, t in enumerate(self.spec.transitions) if t.is_guarded
        }
        if any(": " in label for label in self.outcomes):  # per check: the edge labels go
            out = {}
        for label, seen in self.outcomes.items():
            out.setdefault(label, set()).update(seen)
        return out

    def reachable_reasons(self) -> list[str]:
        """The reasons the workflow's edges (and catch entries) end runs with."""
        return self.spec.edge_reasons()

    def to_dict(self) -> dict[str, Any]:
        declared = self.declared_edges
        states = [s for s in self.spec.states if not self.spec.states[s].is_compound]
        conditions = self.conditions()
        return {
            "workflow": self.spec.path,
            "cases": self.cases,
            "states": {"covered": sorted(self.states & set(states)), "total": len(states),
                       "missed": [s for s in states if s not in self.states]},
            "edges": {"covered": len(self.edges & set(declared)), "total": len(declared),
                      "percent": round(self.edge_percent, 1),
                      "missed": [self._edge(i) for i in declared if i not in self.edges]},
            "conditions": {label: sorted(seen) for label, seen in conditions.items()},
            "reasons": {"reached": sorted(self.reasons),
                        "missed": [r for r in self.reachable_reasons() if r not in self.reasons]},
        }  # fmt: skip

    def lines(self) -> Iterable[str]:
        """The report, for a terminal."""
        d = self.to_dict()
        states, edges, reasons = d["states"], d["edges"], d["reasons"]
        both = [label for label, seen in d["conditions"].items() if len(seen) == 2]
        yield f"coverage of {self.spec.path} ({self.cases} cases):"
        yield f"  states      {len(states['covered'])}/{states['total']}" + _missed(
            states["missed"]
        )
        yield f"  edges       {edges['covered']}/{edges['total']} ({edges['percent']:g}%)" + (
            _missed(edges["missed"])
        )
        yield f"  conditions  {len(both)}/{len(d['conditions'])} seen both true and false"
        for label, seen in d["conditions"].items():
            if len(seen) < 2:
                never = "never evaluated" if not seen else f"never {str(not seen[0]).lower()}"
                yield f"    {label}: {never}"
        yield f"  reasons     reached {', '.join(reasons['reached']) or 'none'}" + _missed(
            reasons["missed"]
        )


def _missed(items: list[str]) -> str:
    return f"; missed: {', '.join(items)}" if items else ""
