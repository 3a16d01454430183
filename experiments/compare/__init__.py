"""``zoo compare`` and ``zoo report``: the command (``command``), one training run per mechanism and seed
(``runs``), the summary with paired verdicts (``summary``), the TensorBoard layout, the experiment lock, and the
report that joins a comparison with a bench (``report``)."""
