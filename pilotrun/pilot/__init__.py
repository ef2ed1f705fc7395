"""A pilot: the gates of one spec run in order, each row to the ledger and ``report.json``."""
from .report import PilotResult, rank_summary, write_report
from .resume import ResumeError, ResumePlan, carry_rows, plan_resume
from .runner import Observer, PilotInterrupted, PilotOptions, run_pilot

__all__ = ["Observer", "PilotInterrupted", "PilotOptions", "PilotResult", "ResumeError", "ResumePlan", "carry_rows",
           "plan_resume", "rank_summary", "run_pilot", "write_report"]
