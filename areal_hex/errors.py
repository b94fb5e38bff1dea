"""Errors every layer may raise and the CLI knows how to print."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user: printed without a traceback, exit code 2."""
