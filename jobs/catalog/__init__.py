"""Catalog enrichment, an application on the queue core: per product of a catalog CSV a
classification, a description and an attribute extraction job, prompted as a job spec says
(:mod:`~weir.jobs.catalog.spec`, shipped specs in ``specs/``), their results kept in the
``product_enrichment`` table, and ``weir enrich`` and the nightly run on top.

Modules: :mod:`~weir.jobs.catalog.enrichment` (reading catalogs, the requests, the incremental
plan, the summary), :mod:`~weir.jobs.catalog.spec` (job specs), :mod:`~weir.jobs.catalog.quality`
(the description check), :mod:`~weir.jobs.catalog.exemplars` (labelled neighbours),
:mod:`~weir.jobs.catalog.extraction` (attribute extraction prompts and scoring).
"""
