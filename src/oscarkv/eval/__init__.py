"""Evaluation harness: OSCAR against BF16 and the baselines on the same model and data."""

from .methods import METHODS, KVMethod, get_method
from .report import summary, summary_markdown, write_report
from .runner import run_eval

__all__ = ["METHODS", "KVMethod", "get_method", "run_eval", "summary", "summary_markdown", "write_report"]
