"""The bench of the user's own code: loading it (also a PATH's ``--model FILE.py:NAME``), their DataLoader rebuilt per setting and timed, the report."""
