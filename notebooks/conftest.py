"""Notebooks under test run with small settings: their parameters cell reads COURSE_QUICK."""

import os

os.environ.setdefault("COURSE_QUICK", "1")
