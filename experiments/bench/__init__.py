"""``zoo bench`` and ``zoo targets``: what is measured (``cases``), how (``measure``, one fresh worker process per
case: ``runner``; on Ray: ``ray_runs``), where it is kept (``store``), the tables, plots and report, FLOP formulas
(``flops``) and the CPU performance targets (``targets``). The sweep configs are ``configs/bench/`` of the
repository."""
