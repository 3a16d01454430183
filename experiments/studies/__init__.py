"""The source papers' claims as reproducible studies (``zoo study <name>``); see ``experiments/studies/cli.py``."""
