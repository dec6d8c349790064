"""A person's approval between evaluation and the alias (promote.approval: required): the promotion flow run pauses
with a form in Prefect's UI (`pause_flow_run(wait_for_input=ApprovalForm)`), whose description carries the
evaluation's summary and links, and waits up to promote.approval_timeout_h for an answer.

The flow waits in its own process (a pause) rather than suspending: a suspended run is started again from the top
on resume, which would sample and judge both policies again. Prefect's open-source server does not record who
answered a form, so the form asks the approver's name; it and the comment become version tags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from pydantic import Field

POLL_S = 10  # how often the paused flow asks Prefect whether it was answered
PAUSE_KEY = "promotion-approval"


class ApprovalForm(RunInput):
    approve: bool = Field(False, description="Move the champion alias to this candidate.")
    approver: str = Field("", description="Your name, kept in the version's tags.")
    comment: str = Field("", description="Why, kept in the version's tags.")


@dataclass(frozen=True)
class Approval:
    status: Literal["approved", "rejected", "timed_out"]
    approver: str = ""
    comment: str = ""

    def sentence(self, timeout_h: float) -> str:
        """The approval in words, for the report and the promotion.approval tag."""
        if self.status == "timed_out":
            return f"no one answered the approval form within promote.approval_timeout_h {timeout_h:g} h"
        who = f" by {self.approver}" if self.approver else ""
        said = f": {self.comment}" if self.comment else ""
        return f"{self.status}{who}{said}"

    def tags(self) -> dict[str, str]:
        """promotion.approval (approved, rejected, timed_out), and who answered and their comment when given."""
        tags = {"approval": self.status}
        if self.approver:
            tags["approved_by" if self.status == "approved" else "rejected_by"] = self.approver
        if self.comment:
            tags["approval_comment"] = self.comment
        return tags


def ask_approval(description: str, timeout_h: float) -> Approval:
    """Pause this flow run for the form; its answer, or timed_out when none came within `timeout_h` hours."""
    timeout = max(1, round(timeout_h * 3600))
    form = ApprovalForm.with_initial_data(description=description, approve=False)
    try:
        answer = pause_flow_run(wait_for_input=form, timeout=timeout, poll_interval=min(POLL_S, timeout), key=PAUSE_KEY)
    except FlowPauseTimeout:
        return Approval("timed_out")
    return Approval("approved" if answer.approve else "rejected", answer.approver.strip(), answer.comment.strip())
