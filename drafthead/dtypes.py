"""Kept for older imports: dtype names live in drafthead.utils (DTYPES, parse_dtype)."""

from __future__ import annotations

from .utils import DTYPES, parse_dtype

__all__ = ["DTYPES", "parse_dtype"]
