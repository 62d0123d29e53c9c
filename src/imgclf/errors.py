"""The one exception type a user can cause and fix (bad config, missing data, no GPU).

The CLI prints its message as one sentence and exits non-zero, without a traceback;
anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """An error whose message tells the user what to change."""
