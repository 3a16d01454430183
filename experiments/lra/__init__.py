"""``zoo lra``: the Long Range Arena suite over ``zoo compare`` (:mod:`experiments.lra.command`)."""
