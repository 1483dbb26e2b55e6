"""What `bind` and `unbind` print: one JSON-ready document built from an Outcome, and its text
form, so the two never disagree. Shape described in docs/lifecycle.md."""

from __future__ import annotations

from typing import Any

from hostdev.binding.bind import Outcome, Restored, Status
from hostdev.binding.plan import Move

SCHEMA = "kubevirt-iommufd/bind/v1"
Document = dict[str, Any]

EXIT_CODES = {
    Status.DONE: 0,
    Status.NOTHING_TO_DO: 0,
    Status.DRY_RUN: 0,
    Status.REFUSED: 1,
    Status.FAILED_RESTORED: 3,
    Status.FAILED_NOT_RESTORED: 4,
}


def build_bind_document(outcome: Outcome) -> Document:
    plan = outcome.plan
    restored = {r.bdf: r for r in outcome.restored}
    functions: list[Document] = []
    for move in plan.moves:
        functions.append(
            {
                "bdf": str(move.bdf),
                "why": move.why,
                "from_driver": move.from_driver,
                "to_driver": _target(move),
                "status": _move_status(outcome, move, restored.get(move.bdf)),
                "driver": outcome.drivers.get(move.bdf, move.from_driver),
            }
        )
    for kept in plan.unchanged:
        functions.append(
            {
                "bdf": str(kept.bdf),
                "why": kept.why,
                "from_driver": kept.driver,
                "to_driver": kept.driver,
                "status": "unchanged",
                "driver": kept.driver,
                "note": kept.note,
            }
        )
    functions.sort(key=lambda f: f["bdf"])
    return {
        "schema": SCHEMA,
        "action": outcome.action,
        "result": outcome.status.value,
        "functions": functions,
        "modules": list(outcome.modules),
        "writes": [str(w) for w in outcome.writes],
        "refusals": [
            {
                "bdf": None if r.bdf is None else str(r.bdf),
                "reason": r.reason,
                "fix": r.fix,
                "busy": r.busy,
                "holders": [
                    {"pid": h.pid, "command": h.command, "path": h.path} for h in r.holders
                ],
            }
            for r in plan.refusals
        ],
        "error": outcome.error,
        "restored": [
            {
                "bdf": str(r.bdf),
                "driver": r.driver,
                "override": r.override,
                "ok": r.ok,
                "problems": list(r.problems),
            }
            for r in outcome.restored
        ],
        "waited_seconds": round(outcome.waited_seconds, 1),
    }


def _target(move: Move) -> str | None:
    if move.reprobe:
        return "(kernel's choice)"
    return move.to_driver


def _move_status(outcome: Outcome, move: Move, restored: Restored | None) -> str:
    if outcome.status is Status.DRY_RUN:
        return "would-move"
    if outcome.status is Status.DONE:
        return "moved"
    if restored is None:
        return "not-moved"
    return "restored" if restored.ok else "not-restored"


def render_bind_table(document: Document) -> str:
    action = document["action"]
    lines: list[str] = []
    rows = [("BDF", "WHY", "DRIVER", "", "TARGET", "STATUS")]
    for function in document["functions"]:
        moving = function["status"] != "unchanged"
        rows.append(
            (
                function["bdf"],
                function["why"],
                function["from_driver"] or "-",
                "->" if moving else "",
                (function["to_driver"] or "-") if moving else "",
                function.get("note") or function["status"],
            )
        )
    if len(rows) > 1:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
    if document["modules"]:
        verb = "would load" if document["result"] == "dry-run" else "loaded"
        lines.append(f"modules {verb}: {', '.join(document['modules'])}")
    lines.extend(_result_lines(document, action))
    return "\n".join(lines) + "\n"


def _result_lines(document: Document, action: str) -> list[str]:
    result = document["result"]
    moved = sum(1 for f in document["functions"] if f["status"] in ("moved", "would-move"))
    if result == "done":
        return [f"{action}: done, {_count(moved, 'function')} moved"]
    if result == "nothing-to-do":
        return [f"{action}: nothing to do"]
    if result == "dry-run":
        return [
            f"{action}: dry run, {_count(moved, 'function')} would move with these writes:",
            *(f"  {w}" for w in document["writes"]),
        ]
    if result == "refused":
        waited = document["waited_seconds"]
        after = f" after waiting {waited:g} s" if waited else ""
        lines = [f"{action}: refused{after}; nothing was changed"]
        for refusal in document["refusals"]:
            subject = f"{refusal['bdf']}: " if refusal["bdf"] else ""
            lines.append(f"  {subject}{refusal['reason']}; {refusal['fix']}")
        return lines
    lines = [f"{action}: failed: {document['error']}"]
    for item in document["restored"]:
        state = f"{item['driver'] or 'no driver'}, override {item['override'] or 'none'}"
        if item["ok"]:
            lines.append(f"  restored {item['bdf']}: back on {state}")
        else:
            lines.append(f"  NOT restored {item['bdf']}: now on {state}")
            lines.extend(f"    {problem}" for problem in item["problems"])
    if result == "failed-not-restored":
        lines.append("  the host needs attention: put the functions above back by hand")
    return lines


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
