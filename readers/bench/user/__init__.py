"""The bench of the user's own code: loading it, their DataLoader rebuilt per setting and timed, the report."""
