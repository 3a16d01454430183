"""``zoo bench`` and ``zoo targets``: what is measured (``cases``), how (``measure``, one fresh worker process per
case: ``runner``), where it is kept (``store``), the tables, plots and report, FLOP formulas (``flops``), the CPU
performance targets (``targets``) and the sweep configs (``configs/``)."""
