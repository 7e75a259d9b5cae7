"""User-facing error types.

Anything a user can fix (a bad config key, a missing data file) raises one of these. ``train.py``
and the tools print such an error as a single line and exit with a non-zero code, without a
traceback. Programming errors stay ordinary exceptions and keep their traceback.
"""
from __future__ import annotations

import argparse
from typing import NoReturn


class UserError(Exception):
    """Base class: an error in the user's input, printed as one line."""

    exit_code = 1


class ConfigError(UserError):
    """A config key, value or combination is invalid. Exit code 2."""

    exit_code = 2


class DataError(UserError):
    """A data, tokenizer or checkpoint file is missing or malformed."""

    exit_code = 1


class TrainingError(UserError):
    """Training cannot go on (a non-finite loss or gradient norm): the message names the step."""

    exit_code = 1


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line (exit code 2) instead of usage + message,
    like every other user error of train.py and the tools."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
